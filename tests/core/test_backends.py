"""Each speed backend of the core equals the plain PyTorch reference it replaces."""

from __future__ import annotations

import pytest
import torch

from esamp.core import intervention as iv
from esamp.core.distiller import DistillerBank, RowLayout


def train_step(bank, x, y, layout):
    """One optimizer step on the layout's training units: their losses (before the step)."""
    return bank.step(x, y, layout)[2][list(layout.training)]


CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_flat_fused_update_matches_torch_optimizers_per_slot(optimizer):
    """Each slot steps exactly like its own torch optimizer, whether its rows are read in place
    (consecutive slots) or gathered (scattered slots)."""
    H, r = 12, 3
    for slots in ([0, 1], [2, 0], [1]):
        bank = DistillerBank(H, rank=r, slots=3, optimizer=optimizer, lr=1e-2, seed=4)
        store = bank.store
        ref = {s: store.flat[s].clone().requires_grad_(True) for s in set(slots)}
        opt = {
            s: (torch.optim.Adam([ref[s]], lr=1e-2) if optimizer == "adam" else torch.optim.SGD([ref[s]], lr=1e-2))
            for s in ref
        }
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            rows = [s for s in slots for _ in range(2)]
            x, y = torch.randn(len(rows), H, generator=gen), torch.randn(len(rows), H, generator=gen)
            for s in ref:
                p = {k: store.view(ref[s].unsqueeze(0), k) for k in bank.PARAMS}
                own = [i for i, t in enumerate(rows) if t == s]
                loss = iv_free_error(bank, x[own], y[own], p).mean()
                opt[s].zero_grad()
                loss.backward()
                opt[s].step()
            train_step(bank, x, y, RowLayout.from_slots(rows))
            for s in ref:
                torch.testing.assert_close(store.flat[s], ref[s].detach(), rtol=1e-5, atol=1e-6)


def iv_free_error(bank, x, y, p):
    from esamp.core.distiller import row_error

    return row_error(bank._forward(x, RowLayout.from_slots([0] * len(x)).shape, p), y)


def test_one_pass_step_equals_predict_then_train():
    """The one-pass step gives what separate predict / row_error / train_step give, also inside
    inference mode (as in vLLM's sampler)."""
    for optimizer in ("adam", "sgd"):
        a = DistillerBank(16, rank=4, slots=3, optimizer=optimizer, seed=5)
        b = DistillerBank(16, rank=4, slots=3, optimizer=optimizer, seed=5)
        for g in ("p", "q"):
            a.allocate(g), b.allocate(g)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            layout = RowLayout.from_slots([1, 0, 1])
            x, y = torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen)
            want_pred = a.predict(x, layout)
            want_loss = train_step(a, x, y, layout)
            with torch.inference_mode():
                pred, err, loss = b.step(x, y, RowLayout.from_slots([1, 0, 1]))
            torch.testing.assert_close(pred, want_pred)
            assert torch.equal(loss, want_loss)
            torch.testing.assert_close(err, DistillerBank.row_error(want_pred, y))
        for k in a.PARAMS:
            assert torch.equal(a.params[k], b.params[k])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("mix", ["paper", "unsharpened"])
def test_fused_mix_equals_the_reference_mix(device, mix):
    """The fused mix-and-count (Triton on a GPU, PyTorch elsewhere) equals the core's ``mix``
    with −∞ kept, counts |C|, and with β = 0 returns z̃ bit for bit."""
    if device == "cuda" and not CUDA:
        pytest.skip("needs a CUDA GPU")
    from esamp.core.backends.triton_mix import mix_and_count

    gen = torch.Generator().manual_seed(5)
    R, V = 6, 10_000
    z = torch.randn(R, V, generator=gen)
    z[torch.rand(R, V, generator=gen) < 0.7] = float("-inf")
    d = torch.randn(R, V, generator=gen).to(torch.bfloat16)
    betas = [0.0, 0.8, 0.8, 2.0, 0.0, 0.3]
    a, b = iv.mix_coefficients([(mix, beta) for beta in betas])
    fin = torch.isfinite(z)
    want = torch.where(fin, iv.mixed(z, d.float(), a, b), z)
    got, count = mix_and_count(z.clone().to(device), d.to(device), a.to(device), b.to(device))
    got = got.cpu()
    assert torch.equal(count.cpu().long(), fin.sum(-1)) and torch.equal(torch.isfinite(got), fin)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-6, atol=1e-5)
    for r in (0, 4):  # β = 0
        assert torch.equal(got[r], z[r])


def in_a_fresh_process(code: str) -> None:
    """Run ``code`` in a new Python process (its CUDA work is the first that process does)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_graphed_step_equals_eager_steps_even_as_the_first_cuda_work():
    """A CUDA-graph replay of the Distiller step does what the eager step does, step after step,
    and capturing works on a cold stream: run alone in a fresh process, this is the first CUDA
    work that process does (cuBLAS initialised by nothing else)."""
    code = (
        "import torch\n"
        "from esamp.core.backends.graphs import GraphCache\n"
        "from esamp.core.distiller import DistillerBank, RowLayout\n"
        "dev = torch.device('cuda')\n"
        "banks = [DistillerBank(64, rank=8, slots=4, device=dev, seed=2) for _ in range(2)]\n"
        "for bank in banks:\n"
        "    [bank.allocate(g) for g in 'abc']\n"
        "slots = [0, 0, 2, 1, 2]\n"
        "layouts = [RowLayout.from_slots(slots, device=dev) for _ in banks]\n"
        "cache = GraphCache(after=1)\n"
        "gen = torch.Generator(device=dev).manual_seed(0)\n"
        "for i in range(6):\n"
        "    x = torch.randn(5, 64, device=dev, generator=gen); y = torch.randn(5, 64, device=dev, generator=gen)\n"
        "    want = banks[0].step(x, y, layouts[0])\n"
        "    got = cache.run('k', lambda gx, gy: banks[1].step(gx, gy, layouts[1]), x, y)\n"
        "    for w, g in zip(want, got):\n"
        "        torch.testing.assert_close(g, w)\n"
        "torch.testing.assert_close(banks[1].store.flat, banks[0].store.flat)\n"
        "assert cache.captures == 1 and cache.replays == 4 and not cache.failures, vars(cache)\n"
    )
    in_a_fresh_process(code)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_shared_pool_outlives_no_graph_of_it():
    """With a shared pool, a cache whose every graph went (evicted, or cleared) captures again into
    a new pool: PyTorch releases a pool with its last graph, and a capture into the released pool's
    handle fails an allocator assert. Seen on the GPU suite when a test cleared the engine's cache."""
    code = (
        "import torch\n"
        "from esamp.core.backends.graphs import GraphCache\n"
        "dev = torch.device('cuda')\n"
        "x = torch.randn(8, 64, device=dev)\n"
        "step = lambda t: (t @ t.t()).relu().sum(0)\n"
        "cache = GraphCache(after=0, size=1, shared_pool=True)\n"
        "cache.run('warm', step, x)\n"  # the first call warms the capture stream eagerly
        "for i in range(6):\n"  # size 1: every capture evicts the other key's graph, the pool's last
        "    got = cache.run(('k', i % 2), step, x)\n"
        "    torch.testing.assert_close(got, step(x))\n"
        "cache.graphs.clear()\n"
        "torch.testing.assert_close(cache.run('again', step, x), step(x))\n"
        "assert cache.captures == 7 and not cache.failures and cache.enabled, vars(cache)\n"
    )
    in_a_fresh_process(code)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_an_update_beside_the_stream_equals_the_update_in_line():
    """The Distiller's update on a side stream (the vLLM engine's) gives every step the ŷ, errors
    and losses of the update made in line, and the same parameters in the end, while the main
    stream rewrites the taps and the plan right after each step and a group's slot is freed and
    taken again between steps (each must wait for the update in flight, and does). So does the
    update in line inside the step's own graph (``ESAMP_UPDATE=inline``)."""
    from esamp.core.backends.graphs import GraphCache, SideStream
    from esamp.core.config import Filters, Steering
    from esamp.core.steerer import PlanBuffers, SteeredRow, Steerer, StepPlan

    dev, H = torch.device("cuda"), 512
    banks = [DistillerBank(H, rank=16, slots=4, device=dev, seed=3) for _ in range(3)]
    for bank in banks:
        for g in "abc":
            bank.allocate(g)
    steerers = [
        Steerer(banks[0]),
        Steerer(
            banks[1],
            graphs=GraphCache(after=0, in_place=True, shared_pool=True),
            beside=SideStream(GraphCache(after=0, in_place=True)),
        ),
        Steerer(banks[2], graphs=GraphCache(after=0, in_place=True, shared_pool=True)),  # one graph, update in it
    ]
    buffers = [PlanBuffers(rows=16, units=4, width=8, device=dev, scratch=b.scratch) for b in banks]
    taps = [torch.zeros(17, 2 * H, device=dev) for _ in banks]
    noise = torch.randn(4096, 4096, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    batches = [[0, 0, 1, 2, 2, 2], [0, 1, 1, 2], [0, 0, 1, 2, 2, 2]]
    for i in range(10):
        if i == 5:  # group b ends; d takes its slot, re-initialised
            for bank in banks:
                assert bank.free("b") == 1 and bank.allocate("d") == 1
        slots = batches[i % len(batches)]
        rows = [SteeredRow(s, Steering(beta=0.8, train_rows="all"), Filters()) for s in slots]
        fresh = torch.randn(len(slots), 2 * H, device=dev, generator=gen)
        outs = []
        for steerer, buf, tap in zip(steerers, buffers, taps):
            tap[: len(slots)].copy_(fresh)
            plan = StepPlan.build(rows, dev, index=list(range(len(rows))), buffers=buf)
            outs.append([t.clone() for t in steerer.distill(plan, tap[:, :H], tap[:, H:])])
            tap.normal_()  # the next step's taps, while the update may still run
            tap[-1].zero_()
            noise @ noise  # keeps the main stream busy beside it
        (pred, err, loss), *others = outs
        n = len(slots)
        for pred2, err2, loss2 in others:
            torch.testing.assert_close(pred2[:n], pred[:n])
            torch.testing.assert_close(err2[:n], err[:n])
            torch.testing.assert_close(loss2[:3], loss[:3])
    for bank in banks[1:]:
        for a, b in ((bank.store.flat, banks[0].store.flat), (bank.store.steps, banks[0].store.steps)):
            torch.testing.assert_close(a, b)
    assert steerers[1].beside.graphs.replays > 0 and not steerers[1].beside.graphs.failures
    assert steerers[2].graphs.replays > 0 and not steerers[2].graphs.failures


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_priority_lane_runs_after_the_current_streams_work_and_before_its_next():
    """``PriorityLane.run`` (the filter and mix beside an update, ESAMP_MIX_STREAM=priority) reads
    what the current stream wrote just before it, its result is what the current stream reads just
    after, and the current stream is the same one afterwards, on a stream of a higher priority."""
    from esamp.core.backends import streams
    from esamp.core.backends.graphs import PriorityLane

    dev = torch.device("cuda")
    lane, main = PriorityLane(), torch.cuda.current_stream()
    big = torch.randn(4096, 4096, device=dev)
    x = torch.zeros(1 << 20, device=dev)
    for i in range(5):
        big @ big  # the current stream busy, so an unordered lane would read x too early
        x.fill_(float(i))
        out = lane.run(lambda: x * 2 + 1)
        assert streams.current(streams.index_of(dev)) == main
        y = out + 1  # read on the current stream right after
        assert torch.equal(y, torch.full_like(x, 2.0 * i + 2))
    assert lane.runs == 5 and lane._stream.priority < main.priority


FLAT_KERNEL_CHECK = """
import copy, torch
from esamp.core.backends import flat
for optimizer in ('adam', 'sgd'):
    store = flat.FlatParameters({'a': (5, 7), 'b': (3,)}, 3, torch.device('cpu'))
    gen = torch.Generator().manual_seed(0)
    store.initialise([{'a': torch.randn(5, 7, generator=gen), 'b': torch.randn(3, generator=gen)} for _ in range(4)])
    ref = copy.deepcopy(store)
    units, counts = torch.tensor([2, 0, 3]), torch.tensor([1.0, 2.0, 0.0])  # slot 3: the scratch, not trained
    for _ in range(3):
        grads = {k: torch.randn(3, *shape, generator=gen) for k, shape in store.shapes.items()}
        ref.update(units, counts, grads, optimizer, 1e-2)  # the PyTorch arithmetic (a CPU tensor)
        store.steps.index_add_(0, units, (counts > 0).float())
        for name, grad in grads.items():
            a, b = store.spans[name]
            flat._update_kernel[(3, 1)](store.flat, store.flat_m, store.flat_v, store.steps, grad.contiguous(),
                units, counts, store.flat.stride(0), a, b - a, 1e-2, *flat.ADAM_BETAS, flat.ADAM_EPS,
                ADAM=optimizer == 'adam', BLOCK=64)
    for mine, theirs in ((store.flat, ref.flat), (store.flat_m, ref.flat_m), (store.flat_v, ref.flat_v)):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
"""


# Started early by the run (tests/core/_interpreter.py).
INTERPRETER_RUNS = {
    "test_the_flat_optimizer_kernel_equals_its_pytorch_arithmetic_in_tritons_interpreter": FLAT_KERNEL_CHECK
}


@pytest.mark.skipif(CUDA, reason="the kernel runs on the GPU there")
def test_the_flat_optimizer_kernel_equals_its_pytorch_arithmetic_in_tritons_interpreter():
    """The optimizer kernel a GPU runs (``backends.flat``, whose ``opt_step`` the fused Distiller
    step calls too) does what the PyTorch update does, for Adam and SGD, leaving a slot with no
    training rows alone."""
    from _interpreter import in_tritons_interpreter

    done = in_tritons_interpreter(FLAT_KERNEL_CHECK, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
