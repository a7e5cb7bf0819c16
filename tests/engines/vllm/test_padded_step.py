"""The padded filter-and-mix step (``EngineSteering._padded_step``): one CUDA graph per bucket of
rows, captured before the first request and replayed for logits at any address and any row count
of its bucket, changes the logits and records what the step of the plan's exact rows does.

Two engines with the same Distiller initialisation take the same batches: one steps padded, the
other (its padded graphs off) the way every plan can, eagerly. On a GPU the padded engine captures
nothing after ``prepare`` for d at the candidates and for steps with no row mixed, whatever the
logits' address; on the CPU the same check runs the kernels in Triton's interpreter, the padded
engine's graphs stood in for by direct calls (the step's code, its buffers and its records, minus
the capture).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "core"))
from _interpreter import in_tritons_interpreter  # noqa: E402 (tests/core's, where the interpreter runs start)

CUDA = torch.cuda.is_available()
H, V, ROWS = 64, 5_000, 16  # max_num_seqs 16: buckets of 1, 2, ..., 16 rows


class _Direct:
    """A ``GraphCache`` that calls instead of capturing (the CPU has no graphs): the padded step's
    code runs as it would, each call counted as a replay."""

    enabled = True

    def __init__(self) -> None:
        self.replays = self.captures = self.eager = self.failures = 0
        self.capture_seconds = 0.0
        self.graphs: dict = {}

    def run(self, key, fn, *inputs):
        self.replays += 1
        self.graphs[key] = fn  # (from its second call on, a key replays "its graph")
        return fn(*inputs)

    def prepare(self, key, fn, *inputs) -> bool:
        self.captures += 1
        return True


def _rows(groups: dict[str, int], **filters):
    from esamp.core.config import Filters, Steering
    from esamp.engines.vllm.rows import RequestRow

    rows, i = {}, 0
    for group, n in groups.items():
        for sample in range(n):
            rows[i] = RequestRow(
                group, sample, Steering(beta=0.8), Filters(temperature=0.9, **filters), [0] * 3, records=True, n=n
            )
            i += 1
    return rows


def check_padded_step(device: str) -> None:
    from esamp.core.config import EsampConfig
    from esamp.core.intervention import HeadProduct
    from esamp.engines.vllm.steering import EngineSteering

    dev = torch.device(device)
    engines = [
        EngineSteering(EsampConfig(slots=4, rank=8, lr=0.05), hidden=H, vocab=V, max_rows=ROWS, device=dev)
        for _ in range(2)
    ]
    padded, direct = engines
    if dev.type == "cuda":
        direct.padded_graphs.enabled = direct.apply_graphs.enabled = False  # every step eager, exact rows
    else:
        padded.padded_graphs = _Direct()
    gen = torch.Generator().manual_seed(3)
    # A padded vocabulary; bf16 as a model's on a GPU, fp32 on the CPU, where the exact step's PyTorch
    # twin multiplies the factors out in the head's dtype and the kernels sum in fp32.
    head = (torch.randn(V + 7, H, generator=gen) / 4).to(torch.bfloat16 if dev.type == "cuda" else torch.float32)
    head = head.to(dev)
    for engine in engines:
        engine.prepare(torch.zeros(ROWS, 2 * H, dtype=torch.bfloat16, device=dev), 0, 1, None, torch.bfloat16, head)
    prepared = padded.counters["padded_prepared"]
    if dev.type == "cuda":
        assert prepared == 5 * 2 * 2  # buckets 1-16 × top-p or not × d at the candidates or no row mixed
    steps = [  # (groups in the batch, logits rows, filters): row counts move inside and across buckets
        ({"a": 4, "b": 8}, 12, dict(min_p=0.05, top_p=0.9)),
        ({"a": 4, "b": 8}, 12, dict(min_p=0.05, top_p=0.9)),
        ({"a": 4, "b": 5}, 9, dict(min_p=0.05, top_p=0.9)),  # b shrank: same bucket, fewer rows
        ({"b": 5, "c": 3}, 10, dict(min_p=0.1, top_p=1.0)),  # a new group; no top-p: the two-pass form
        ({"c": 3}, 5, dict(min_p=0.1, top_p=1.0)),  # another bucket
        ({"c": 3, "d": 16 - 3}, 16, dict(min_p=0.02, top_p=0.95)),  # the largest bucket, whole
    ]
    for step, (groups, n_logits, filters) in enumerate(steps):
        rows = _rows(groups, **filters)
        aux = (torch.randn(n_logits, 2 * H, generator=gen) * 2).to(torch.bfloat16).to(dev)
        base = torch.randn(n_logits, V, generator=gen) * 4
        outs = []
        for engine in engines:
            plan = engine.plan(rows, n_logits)
            assert engine.keep_taps(aux)
            handoff = engine.distill(plan, 0, 1, None, torch.bfloat16)
            handoff.d = HeadProduct(handoff.prediction[: plan.steered], head)
            # logits at a new address every step (and another for each engine), as vLLM's sampler's
            logits = torch.empty(n_logits + step + 1, V, device=dev)[step + 1 :]
            logits.copy_(base)
            outs.append(engine.apply(plan, logits, handoff).cpu())
        got, want = outs
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), step
        kept = torch.isfinite(want)
        if dev.type == "cuda":  # the same kernels on the same rows: bit for bit
            assert torch.equal(got[kept], want[kept]), step
        else:  # the kernels (interpreted) against the PyTorch twin
            torch.testing.assert_close(got[kept], want[kept], rtol=1e-5, atol=1e-4)
    assert padded.padded_graphs.replays == len(steps)
    if dev.type == "cuda":
        assert padded.padded_graphs.captures == prepared  # nothing captured on a step's path
        assert padded.apply_graphs.captures == padded.apply_graphs.replays == 0
    records = [[(r["step"], r["rows"], r["loss"]) for r in engine.drain()["steps"]] for engine in engines]
    assert [(s, [row[:3] for row in rows]) for s, rows, _ in records[0]] == [
        (s, [row[:3] for row in rows]) for s, rows, _ in records[1]
    ]  # (group, sample, generated) of every row of every step, in order
    for (step, rows, loss), (_, want_rows, want_loss) in zip(*records):
        assert [row[4] for row in rows] == [row[4] for row in want_rows], step  # candidate counts
        torch.testing.assert_close(torch.tensor([row[3] for row in rows]), torch.tensor([row[3] for row in want_rows]))
        assert loss.keys() == want_loss.keys() and loss, step
        torch.testing.assert_close(torch.tensor(list(loss.values())), torch.tensor(list(want_loss.values())))
    assert sum(len(rows) for _, rows, _ in records[0]) == sum(sum(g.values()) for g, _, _ in steps)


class _Beside:
    """The CPU's stand-in for the side stream: it runs the update at once (nothing in flight)."""

    def __init__(self) -> None:
        self.runs = 0

    def run(self, key, fn, *inputs, graphed=True):
        self.runs += 1
        fn(*inputs)


class _Lane:
    """The CPU's stand-in for the priority lane: it runs the call at once, and counts it."""

    def __init__(self) -> None:
        self.runs = 0

    def run(self, fn, *args):
        self.runs += 1
        return fn(*args)


def _marking(run, inside: list):
    """``run`` that notes, while it runs, that the host is inside a graph's call."""

    def marked(*args):
        inside.append(1)
        try:
            return run(*args)
        finally:
            inside.pop()

    return marked


def check_one_graph_step(device: str) -> None:
    """A late adapter's step as one graph (``EngineSteering.step_late``, its update in line): from
    a plan's third step on, the Distiller step and the padded filter and mix run as one call, and
    the logits and records are what the two steps apart give (an engine stepping every plan the
    exact way, its update beside on a GPU). The engine runs as ESAMP_UPDATE=auto does, in line
    for blocks of up to 16 cells: the middle batch's block (26 cells) takes its update beside and
    its steps apart, its filter and mix replayed on a stream of the highest priority
    (ESAMP_MIX_STREAM=priority), and the batch after it, one graph again, first waits for that
    update."""
    from esamp.core.backends.graphs import PriorityLane
    from esamp.core.config import EsampConfig
    from esamp.core.intervention import HeadProduct
    from esamp.engines.vllm.steering import EngineSteering

    from _trace_steering import TracingSteering  # the engine tests' steering: it must see the one graph too

    dev = torch.device(device)
    engines = [
        kind(EsampConfig(slots=4, rank=8, lr=0.05), hidden=H, vocab=V, max_rows=ROWS, device=dev)
        for kind in (TracingSteering, EngineSteering)
    ]
    fused, direct = engines
    TracingSteering.traces.clear()
    fused.steerer.inline_cells = 16  # ESAMP_UPDATE=auto: in line for blocks of up to 16 cells
    if dev.type != "cuda":
        fused.steerer.beside = _Beside()
    lane = fused.mix_lane = PriorityLane() if dev.type == "cuda" else _Lane()
    settled, inside = [], []  # the bank's waits for an update beside, made outside a graph's call
    settle = fused.bank.settle

    def counted():
        if not inside:
            settled.append(1)
        settle()

    fused.bank.settle = counted
    if dev.type == "cuda":
        direct.padded_graphs.enabled = direct.apply_graphs.enabled = False
        direct.steerer.inline_cells = 0  # every update beside (ESAMP_UPDATE=beside), whatever the default
    else:
        fused.padded_graphs, fused.fused_graphs, fused.steerer.graphs = _Direct(), _Direct(), _Direct()
        for cache in (fused.fused_graphs, fused.steerer.graphs):  # a replay makes none of its host calls
            cache.run = _marking(cache.run, inside)
    gen = torch.Generator().manual_seed(5)
    head = (torch.randn(V + 7, H, generator=gen) / 4).to(torch.bfloat16 if dev.type == "cuda" else torch.float32)
    head = head.to(dev)
    for engine in engines:
        engine.prepare(torch.zeros(ROWS, 2 * H, dtype=torch.bfloat16, device=dev), 0, 1, None, torch.bfloat16, head)
    batches = [  # (groups, logits rows, filters, steps of the same plan): blocks of 16, 26 and 10 cells
        ({"a": 4, "b": 8}, 12, dict(min_p=0.05, top_p=0.9), 4),
        ({"c": 3, "d": 16 - 3}, 16, dict(min_p=0.02, top_p=0.95), 3),
        ({"b": 5, "c": 3}, 10, dict(min_p=0.1, top_p=1.0), 3),
    ]
    inline = [True, False, True]
    total = 0
    for b, (groups, n_logits, filters, steps) in enumerate(batches):
        rows = _rows(groups, **filters)
        plans = [engine.plan(rows, n_logits) for engine in engines]  # one plan a batch, as the adapter keeps it
        for step in range(steps):
            where = (b, step)
            aux = (torch.randn(n_logits, 2 * H, generator=gen) * 2).to(torch.bfloat16).to(dev)
            base = torch.randn(n_logits, V, generator=gen) * 4
            logits = [torch.empty(n_logits + k + 1, V, device=dev)[k + 1 :] for k in range(2)]
            for x in logits:
                x.copy_(base)
            assert fused.keep_taps(aux) and direct.keep_taps(aux)
            settled.clear()
            got = fused.step_late(plans[0], logits[0], (0, 1, None, torch.bfloat16, head)).cpu()
            assert settled, where  # (one graph or apart, the step first waits for an update beside)
            steered = plans[0].step.index[: plans[0].steered].cpu()
            trace = TracingSteering.traces[-1]  # the step's logits as they came, and as it left them
            assert len(TracingSteering.traces) == total + 1 and torch.equal(trace["logits"].cpu(), base[steered])
            assert torch.equal(trace["steered"].cpu(), got[steered]) and len(trace["meta"]) == len(steered)
            handoff = direct.distill(plans[1], 0, 1, None, torch.bfloat16)
            handoff.d = HeadProduct(handoff.prediction[: plans[1].steered], head)
            want = direct.apply(plans[1], logits[1], handoff).cpu()
            assert torch.equal(torch.isfinite(got), torch.isfinite(want)), where
            kept = torch.isfinite(want)
            if dev.type == "cuda":
                assert torch.equal(got[kept], want[kept]), where
            else:
                torch.testing.assert_close(got[kept], want[kept], rtol=1e-5, atol=1e-4)
            total += 1
        assert (plans[0].fused is not None) == inline[b], b  # its later steps were one call, in line
    # every batch in line: one step apart (the padded step learns what it reads), then one call a step
    calls, one_graph = fused.fused_graphs, [n for (_, _, _, n), i in zip(batches, inline) if i]
    assert calls.replays + calls.eager + calls.captures == sum(one_graph) - len(one_graph)
    if dev.type == "cuda":  # one eager call, then a capture and replays, per batch in line
        assert calls.captures == len(one_graph) and calls.eager == len(one_graph) and calls.failures == 0
    else:  # the batch whose update went beside: one update a step
        assert fused.steerer.beside.runs == batches[1][3]
    # that batch's filter and mix went on the lane every step (their key had a graph: the first
    # batch's bucket of rows, and a GPU captures every bucket beforehand); the batches in line never
    assert lane.runs == batches[1][3], lane.runs
    records = [[(r["step"], r["rows"], r["loss"]) for r in engine.drain()["steps"]] for engine in engines]
    assert [(s, [row[:3] for row in rows]) for s, rows, _ in records[0]] == [
        (s, [row[:3] for row in rows]) for s, rows, _ in records[1]
    ]
    for (step, rows, loss), (_, want_rows, want_loss) in zip(*records):
        assert [row[4] for row in rows] == [row[4] for row in want_rows], step
        torch.testing.assert_close(torch.tensor([row[3] for row in rows]), torch.tensor([row[3] for row in want_rows]))
        assert loss.keys() == want_loss.keys() and loss, step
        torch.testing.assert_close(torch.tensor(list(loss.values())), torch.tensor(list(want_loss.values())))
    assert len(records[0]) == total


def test_the_one_graph_step_stays_apart_where_it_does_not_apply():
    """``_fused_step`` declines (the Distiller step and the filter and mix then run apart) before
    its plan's padded step has said what it reads, with the update beside (a GPU's default: the
    one graph would leave the update out), under tensor parallelism (ŷ is broadcast between the
    two), for logits of another width or stride than the padded step was built for, and while the
    Distiller's outputs are not at fixed addresses (its PyTorch path)."""
    from types import SimpleNamespace

    from esamp.core.config import EsampConfig
    from esamp.engines.vllm.steering import EngineSteering
    from esamp.engines.vllm.tp import ALONE

    engine = EngineSteering(EsampConfig(slots=4, rank=8), hidden=H, vocab=V, max_rows=ROWS, device=torch.device("cpu"))
    engine.padded_graphs, engine.fused_graphs, engine.steerer.graphs = _Direct(), _Direct(), _Direct()
    plan = engine.plan(_rows({"a": 2}, min_p=0.1), 2)
    logits = torch.zeros(2, V)
    taps = (0, 1, None, torch.float32, torch.zeros(V, H))
    engine.keep_taps(torch.zeros(2, 2 * H))
    assert engine._fused_step(plan, logits, taps) is None  # no padded step yet
    plan.padded = ("padded", lambda: None, (1, 2, V, V))
    engine.steerer.beside = SimpleNamespace()  # the update beside
    assert engine._fused_step(plan, logits, taps) is None
    engine.steerer.inline_cells = 2  # ESAMP_UPDATE=auto: this plan's block (1 × 2) takes its update in line
    assert engine.steerer.beside_for(plan.step) is None
    engine.steerer.inline_cells = 0
    engine.steerer.beside = None
    engine.tp = SimpleNamespace(size=2)
    assert engine._fused_step(plan, logits, taps) is None
    engine.tp = ALONE
    wider = torch.zeros(2, V + 64)[:, :V]  # the same width, another stride
    assert engine._fused_step(plan, wider, taps) is None
    assert engine.bank.outputs(torch.float32) is None  # no fused Distiller step has run: its outputs move
    assert engine._fused_step(plan, logits, taps) is None
    calls = engine.fused_graphs
    assert calls.replays == calls.captures == calls.eager == 0 and plan.fused is None


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_padded_step_replays_what_the_exact_step_does_on_a_gpu():
    check_padded_step("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_one_graph_step_replays_what_the_two_steps_do_on_a_gpu():
    check_one_graph_step("cuda")


# In the interpreter: the fused Distiller (its outputs are what the padded step reads), and at most 64
# survivors sorted exactly (the interpreter sorts element by element; min-p leaves these rows a few,
# and a row with more goes through the narrowing passes, as on a GPU).
INTERPRETER_RUNS = {
    "test_the_padded_step_does_what_the_exact_step_does_in_tritons_interpreter": (
        "import os, sys; os.environ['ESAMP_DISTILLER'] = 'fused'; sys.path.insert(0, 'tests/engines/vllm'); "
        "sys.path.insert(0, 'tests/core'); import test_padded_step as t; "
        "from esamp.core.backends import triton_filter as tf; tf.EDGE = 64; t.check_padded_step('cpu')"
    ),
    "test_the_one_graph_step_does_what_the_two_steps_do_in_tritons_interpreter": (
        "import os, sys; os.environ['ESAMP_DISTILLER'] = 'fused'; sys.path.insert(0, 'tests/engines/vllm'); "
        "sys.path.insert(0, 'tests/core'); import test_padded_step as t; "
        "from esamp.core.backends import triton_filter as tf; tf.EDGE = 64; t.check_one_graph_step('cpu')"
    ),
}


@pytest.mark.skipif(CUDA, reason="the kernels run on the GPU there")
def test_the_padded_step_does_what_the_exact_step_does_in_tritons_interpreter():
    code = INTERPRETER_RUNS["test_the_padded_step_does_what_the_exact_step_does_in_tritons_interpreter"]
    done = in_tritons_interpreter(code, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(CUDA, reason="the kernels run on the GPU there")
def test_the_one_graph_step_does_what_the_two_steps_do_in_tritons_interpreter():
    code = INTERPRETER_RUNS["test_the_one_graph_step_does_what_the_two_steps_do_in_tritons_interpreter"]
    done = in_tritons_interpreter(code, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
