"""Pieces of the vLLM engine that need no engine: request preparation, the candidate filter, drift canaries."""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch

from esamp.core import intervention as iv, payload as pl
from esamp.core.config import Filters, Steering
from esamp.engines.vllm import settings as es
from esamp.errors import ConfigError

from _vllm_helpers import Wire as _Wire, lockstep


def _params(**kw):
    from vllm import SamplingParams

    return SamplingParams(**{"n": 1, "temperature": 0.7, "top_p": 0.9, "min_p": 0.05, "top_k": 20, **kw})


@pytest.mark.vllm
def test_prepare_moves_the_filters_and_names_the_group():
    """An ESamp request hands vLLM neutral filters and carries its real ones, its group, n and
    base seed in the flat payload; preparing twice changes nothing more."""
    from esamp.core import payload as pl

    params = _params(n=4, seed=9, extra_args={"esamp_beta": 1.2, "esamp_mix": "unsharpened"})
    es.prepare(params)
    got = pl.decode(params.extra_args)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert got.filters.model_dump() == dict(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05)
    assert got.group and got.n == 4 and got.seed == 9 and got.sample is None
    assert got.steering == {"beta": 1.2, "mix": "unsharpened"}
    before = dict(params.extra_args)
    es.prepare(params)
    assert params.extra_args == before
    greedy = _params(temperature=0.0, extra_args={"esamp": "on"})
    es.prepare(greedy)
    assert greedy.temperature == 0.0


@pytest.mark.vllm
def test_prepare_leaves_plain_requests_alone_and_serves_only_issued_groups(monkeypatch):
    plain = _params()
    es.prepare(plain)
    assert plain.extra_args in (None, {}) and plain.top_p == 0.9
    off = _params(extra_args={"esamp": "off"})
    es.prepare(off)
    assert off.top_p == 0.9 and "esamp_group" not in off.extra_args
    monkeypatch.setenv(es.SERVE_ENV, "1")
    unissued = _params(n=2)  # in a server, a request the middleware issued no group: plain, no slot
    es.prepare(unissued)
    assert unissued.top_p == 0.9 and not unissued.extra_args
    issued = es.ISSUED.issue()
    served = _params(n=2, extra_args={"esamp_group": issued.ticket})
    es.prepare(served)
    assert served.top_p == 1.0 and served.extra_args["esamp_group"] == issued.group
    assert es.ISSUED.end(issued.ticket) == [issued.group]


@pytest.mark.vllm
@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(repetition_penalty=1.1, extra_args={"esamp": "on"}), ["penalties", "esamp"]),
        (dict(extra_args={"esamp_beta": 12}), ["esamp_beta=12", "<= 10"]),
        (dict(extra_args={"esamp_mix": "sharp"}), ["esamp_mix", "paper"]),
        (dict(extra_args={"esamp_bta": 1.0}), ["esamp_bta", "esamp_beta"]),
        (dict(n=65, extra_args={"esamp": "on"}), ["n=65", "64"]),
        (dict(extra_args={"esamp_mix": "x" * 5000}), ["esamp_mix='xxx", "… (5000 characters)"]),
    ],
)
def test_prepare_refuses_what_esamp_cannot_serve(kw, words):
    with pytest.raises(ValueError) as err:
        es.prepare(_params(**kw))
    for word in words:
        assert word in str(err.value)


class _StandIn(SimpleNamespace):  # what prepare reads of vLLM's SamplingParams (which take a weak reference)
    pass


def _stand_in(**kw):
    return _StandIn(
        **{
            "n": 1,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.05,
            "seed": None,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "extra_args": None,
            **kw,
        }
    )


def _count_decodes(monkeypatch) -> dict:
    calls = {"n": 0}
    decode = pl.decode

    def counted(extra):
        calls["n"] += 1
        return decode(extra)

    monkeypatch.setattr(pl, "decode", counted)
    return calls


@pytest.mark.parametrize("served", [False, True])
def test_check_changes_nothing(monkeypatch, served):
    """``check`` (the middleware's admission runs it) answers without touching the params, their
    extra_args or the issued groups, whether it steers, declines or refuses."""
    if served:
        monkeypatch.setenv(es.SERVE_ENV, "1")
    else:
        monkeypatch.delenv(es.SERVE_ENV, raising=False)
    for params in (
        _stand_in(n=4, seed=2, extra_args={"esamp_beta": 1.2}),
        _stand_in(extra_args={"esamp": "off"}),
        _stand_in(),
        _stand_in(repetition_penalty=1.1, extra_args={"esamp": "on"}),
    ):
        before, issued = copy.deepcopy(vars(params)), len(es.ISSUED)
        try:
            es.check(params)
        except ValueError:
            pass
        assert vars(params) == before and len(es.ISSUED) == issued


def test_the_filter_hand_over_gives_vllm_neutral_filters_and_esamp_the_real_ones():
    params = _stand_in(extra_args={"esamp_beta": 1.0})
    es.hand_filters_to_esamp(params, Filters(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05))
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    got = pl.decode(params.extra_args)
    assert got.filters == Filters(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05) and got.steering == {"beta": 1.0}
    greedy = _stand_in(temperature=0.0)
    es.hand_filters_to_esamp(greedy, Filters(temperature=0.0, top_p=0.5))
    assert greedy.temperature == 0.0 and pl.decode(greedy.extra_args).filters.top_p == 0.5


def test_the_library_engine_hands_prepare_typed_settings_and_nothing_is_decoded(monkeypatch):
    """The library engine's settings reach ``prepare`` typed: no decode, and the payload it writes
    is the one the flat way in (encoded settings in extra_args) gives. vLLM's own validate_params
    afterwards finds the params prepared."""
    monkeypatch.delenv(es.SERVE_ENV, raising=False)
    calls = _count_decodes(monkeypatch)
    typed = _stand_in(seed=5)
    es.prepare(typed, settings=es.request_settings("g", 2, Steering(beta=1.5, train=False)))
    es.prepare(typed)  # vLLM's validate_params
    decodes = calls["n"]
    flat = _stand_in(seed=5, extra_args=pl.encode(Steering(beta=1.5, train=False), group="g", sample=2))
    es.prepare(flat)
    assert decodes == 0 and typed.extra_args == flat.extra_args
    assert (typed.temperature, typed.top_p, typed.top_k, typed.min_p) == (1.0, 1.0, 0, 0.0)
    got = pl.decode(typed.extra_args)
    assert (got.group, got.sample, got.seed) == ("g", 2, None) and got.filters.top_k == 20
    assert got.steering_over(Steering()) == Steering(beta=1.5, train=False)


def test_the_engine_core_reads_each_child_of_a_request_from_its_own_payload(monkeypatch):
    """vLLM gives each of a request's n children a copy of its payload (and seed + i): each child
    is one decode, and nothing decoded is kept past it (no cache a later request could read);
    another request's payload gives its own group."""
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm.rows import Groups, request_row

    monkeypatch.delenv(es.SERVE_ENV, raising=False)
    config, groups = EsampConfig(), Groups(None)
    calls = _count_decodes(monkeypatch)
    rows = []
    for beta in (1.1, 1.3):
        params = _stand_in(n=4, seed=7, extra_args={"esamp_beta": beta})
        es.prepare(params)
        before = calls["n"]
        rows.append([request_row(dict(params.extra_args), 7 + i, [], groups, config, False) for i in range(4)])
        assert calls["n"] - before == 4
    for beta, children in zip((1.1, 1.3), rows):
        assert [r.sample for r in children] == [0, 1, 2, 3] and len({r.group for r in children}) == 1
        assert all(r.steering.beta == beta and r.filters.top_k == 20 and r.n == 4 for r in children)
    assert rows[0][0].group != rows[1][0].group


def test_layers_and_architectures_give_clear_errors():
    from esamp.engines.base import resolve_layer

    assert resolve_layer(-1, 30, "target") == 29
    with pytest.raises(ConfigError) as err:
        resolve_layer(30, 30, "target")
    assert err.value.hint
    with pytest.raises(ConfigError) as err:
        es.esamp_architecture("GPT2LMHeadModel")
    assert all(arch in err.value.hint for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM"))
    assert es.esamp_architecture("Gemma3ForCausalLM") == "EsampGemma3ForCausalLM"


@pytest.mark.vllm
def test_core_candidate_mask_equals_vllms_own_filters():
    """Drift canary: the core candidate set is what vLLM's own min-p + top-k/top-p ops keep."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    torch.manual_seed(0)
    for trial in range(40):
        R, V = 6, 800
        z = torch.randn(R, V) * (1 + 5 * torch.rand(1))
        k = torch.randint(0, 40, (R,)) if trial % 2 else torch.zeros(R, dtype=torch.long)
        p = 0.5 + 0.5 * torch.rand(R)
        m = 0.2 * torch.rand(R) if trial % 3 else torch.zeros(R)
        probs = z.softmax(-1)  # vLLM's own min-p, in probability space
        filtered = z.masked_fill(probs < probs.amax(-1, keepdim=True) * m[:, None], float("-inf"))
        kk = torch.where(k > 0, k, torch.full_like(k, V))
        want = torch.isfinite(apply_top_k_top_p_pytorch(filtered.clone(), kk, p))
        assert torch.equal(iv.candidate_mask(z, k, p, m), want), trial
        assert torch.equal(iv.candidate_mask(z, k, p, m, width=V), want), trial


@pytest.mark.vllm
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_processor_filter_equals_core_candidate_mask(device):
    """The processor's filter is the function vLLM's sampler calls on that device. On a CPU (the
    sort) it keeps exactly the core's candidate set. On a GPU vLLM uses a Triton kernel from 8
    rows up, which finds the top-p cut without sorting: it must keep a prefix of each row's
    sorted order, like the sort, and may move that cut only by tokens at the boundary."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from esamp.core.config import Filters, Steering
    from esamp.core.steerer import SteeredRow, StepPlan
    from esamp.engines.vllm.steering import vllm_filter

    gen = torch.Generator().manual_seed(3)
    moved = []
    for trial in range(24):
        R, V = (4, 900) if trial % 4 == 0 else (16, 5000)
        z = torch.randn(R, V, generator=gen) * (1 + 6 * torch.rand(1, generator=gen))
        k = torch.randint(0, 60, (R,), generator=gen) if trial % 2 else torch.zeros(R, dtype=torch.long)
        p = 0.5 + 0.5 * torch.rand(R, generator=gen)
        m = 0.2 * torch.rand(R, generator=gen) if trial % 3 else torch.zeros(R)
        want = iv.candidate_mask(z, k, p, m)
        plan = StepPlan.build(
            [
                SteeredRow(
                    -1, Steering(), Filters(temperature=1.0, top_k=int(k[r]), top_p=float(p[r]), min_p=float(m[r]))
                )
                for r in range(R)
            ],
            device,
            steered=0,
        )
        got = vllm_filter(z.clone().to(device), plan).cpu()
        kept = torch.isfinite(got)
        assert torch.equal(got[kept], z[kept]), trial  # kept tokens keep their z̃
        if device == "cpu" or R < 8:
            assert torch.equal(kept, want), trial
            continue
        order = z.argsort(dim=-1, descending=True)
        in_order = kept.gather(1, order)
        count = in_order.sum(-1)
        # a prefix of the sorted order, never empty, at most the top-k
        kk = torch.where(k > 0, k, torch.full_like(k, V))
        assert torch.equal(in_order, torch.arange(V).expand(R, V) < count[:, None]), trial
        assert (count >= 1).all() and (count <= kk).all(), trial
        moved.append((count - want.sum(-1)).abs())
    if moved:
        moved = torch.cat(moved)
        print(
            f"Triton top-p cut vs the sort: {int((moved > 0).sum())}/{moved.numel()} rows moved, "
            f"at most {int(moved.max())} tokens"
        )
        assert (moved > 0).float().mean() <= 0.1 and int(moved.max()) <= 3


def test_bench_workload_parsing():
    from esamp.commands.bench.workloads import parse_workload

    assert parse_workload("16x64") == (16, 1, 64)
    assert parse_workload("32xn8x256") == (32, 8, 256)
    with pytest.raises(ConfigError):
        parse_workload("16by64")


@pytest.mark.parametrize(
    "args",
    [
        ["--trials", "0"],
        ["--seed", "-1"],
        ["--gpu-memory-utilization", "1.5"],
        ["--workloads", "16by64"],
        ["--tensor-parallel-size", "0"],
    ],
)
def test_bench_refuses_bad_options_before_loading_anything(args, capsys):
    from esamp.commands.cli import main

    assert main(["bench", "--model", "no-such-model", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no-such-model" not in err  # refused before the model is looked up


@pytest.mark.cuda
def test_cuda_check_leaves_the_process_able_to_fork_cuda_users():
    """vLLM forks its engine core: our CUDA check must not initialise CUDA in the parent."""
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    code = (
        "import multiprocessing as mp, torch\n"
        "from esamp.platform.devices import cuda_available\n"
        "assert cuda_available()\n"
        "def child():\n"
        "    torch.zeros(1, device='cuda')\n"
        "p = mp.get_context('fork').Process(target=child); p.start(); p.join()\n"
        "raise SystemExit(p.exitcode)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_the_adapter_built_last_is_the_live_one_and_finds_the_same_steering():
    """vLLM may build several ESamp adapters for one engine (the entry point's and a named one, or
    a rebuilt input batch): the last one works, the others stay out of the way, and all share
    the engine's one ``EngineSteering`` (one Distiller bank)."""
    from types import SimpleNamespace

    from esamp.engines.vllm.exchange import exchange_for

    config = SimpleNamespace(instance_id="test-engine-1")
    other = SimpleNamespace(instance_id="test-engine-1")
    made = []

    def make():
        made.append(object())
        return made[-1]

    first, second = object.__new__(type("A", (), {})), object.__new__(type("B", (), {}))
    x = exchange_for(config)
    assert x.attach_adapter(first, make) is made[0]
    assert x.attach_adapter(second, make) is made[0] and len(made) == 1
    assert x.is_live(second) and not x.is_live(first)
    config.instance_id = "renamed"  # vLLM may rename an engine after building its parts
    assert exchange_for(config) is x
    assert exchange_for(other) is not x  # another engine (another configuration object)


def test_a_put_for_another_plan_is_a_step_mismatch():
    """The exchange refuses to hand one step's taps to another step's rows."""
    from types import SimpleNamespace

    from esamp.engines.vllm.exchange import StepExchange, StepMismatch
    from esamp.engines.vllm.steering import Handoff

    x = StepExchange("k")
    plan_a, plan_b = SimpleNamespace(), SimpleNamespace()
    assert x.take(plan_a) is None  # nothing put: no taps this step
    x._handoff = Handoff(plan_a, None, None, None, False, 0.0)
    with pytest.raises(StepMismatch):
        x.take(plan_b)
    x._handoff = Handoff(plan_a, None, None, None, False, 0.0)
    assert x.take(plan_a).plan is plan_a and x.take(plan_a) is None


@pytest.mark.vllm
def test_a_group_trains_once_all_its_samples_have_arrived():
    """A served request's children reach the engine one after another: the group's Distiller
    trains from the step where all n have been in a batch (and then on, whoever has finished)."""
    from esamp.core.config import Filters, Steering
    from esamp.engines.vllm.rows import Groups, RequestRow

    groups = Groups(None)
    rows = [RequestRow("g", s, Steering(), Filters(), [], records=False, n=3) for s in range(3)]
    for r in rows[:2]:
        groups.arrived(r)
    assert not groups.complete(rows[0])
    groups.arrived(rows[2])
    assert all(groups.complete(r) for r in rows)
    assert groups.complete(RequestRow("h", 0, Steering(), Filters(), [], records=False, n=None))


def test_the_gpu_share_comes_from_the_caller_the_environment_or_the_default(monkeypatch):
    from esamp.engines.vllm.engine import GPU_SHARE, GPU_SHARE_ENV, gpu_share

    monkeypatch.delenv(GPU_SHARE_ENV, raising=False)
    assert gpu_share(None) == GPU_SHARE and gpu_share(0.3) == 0.3
    monkeypatch.setenv(GPU_SHARE_ENV, "0.5")
    assert gpu_share(None) == 0.5
    for bad in ("1.5", "half", "0"):
        monkeypatch.setenv(GPU_SHARE_ENV, bad)
        with pytest.raises(ConfigError) as err:
            gpu_share(None)
        assert GPU_SHARE_ENV in str(err.value) and err.value.hint


@pytest.mark.vllm
def test_a_second_compute_logits_after_sampling_is_not_steered():
    """vLLM computes prompt logprobs with a second compute_logits on the prompt rows after the
    step's sampler ran: the V1 adapter has no plan for it (those rows are not the batch's), and a
    tap buffer never takes more rows than a batch holds."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from esamp.core.config import EsampConfig
    from esamp.engines.vllm.v1 import V1Adapter

    config = SimpleNamespace(
        model_config=SimpleNamespace(get_vocab_size=lambda: 32, get_hidden_size=lambda: 8, logits_processors=None),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        additional_config={es.KEY: es.engine_settings(EsampConfig(slots=2, rank=2), 2)},
    )
    adapter = V1Adapter(config, torch.device("cpu"), False)
    params = SamplingParams(extra_args={"esamp": "on"})
    es.prepare(params)
    adapter.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, params, [1, 2], [])], moved=[]))
    assert adapter.plan(1) is not None
    adapter.apply(torch.randn(1, 32))
    assert adapter.plan(1) is None and adapter.plan(7) is None  # the step's sampler has run
    adapter.update_state(None)  # the next step
    assert adapter.plan(1) is not None
    assert adapter.steering.keep_taps(torch.zeros(4, 16)) and not adapter.steering.keep_taps(torch.zeros(9, 16))


def test_building_an_engines_steering_starts_nothing_and_runs_the_steps_registered_here(monkeypatch):
    """``make_steering`` starts no thread and touches no signal handler, even for an engine with
    esamp serve's settings: what a served engine adds are steps that only esamp serve's processes
    register (``esamp.serving.plugin``). Registered steps run with the steering and the configuration."""
    import signal
    import threading
    from types import SimpleNamespace

    from esamp.core.config import EsampConfig
    from esamp.engines.vllm import hooks
    from esamp.engines.vllm.steering import make_steering

    config = SimpleNamespace(
        model_config=SimpleNamespace(get_vocab_size=lambda: 32, get_hidden_size=lambda: 8),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        additional_config={
            es.KEY: es.engine_settings(EsampConfig(slots=2, rank=2), 2),
            es.SERVER_KEY: {"records_requested": True, "host": "127.0.0.1", "port": 1},
        },
    )
    monkeypatch.setattr(hooks, "_STEPS", [])
    threads, handler = set(threading.enumerate()), signal.getsignal(signal.SIGTERM)
    steering = make_steering(config, torch.device("cpu"))
    assert set(threading.enumerate()) <= threads and signal.getsignal(signal.SIGTERM) is handler
    assert not steering.record_all  # esamp serve's settings still reach the steering
    seen = []
    hooks.when_steering_ready(lambda *args: seen.append(args))
    steering = make_steering(config, torch.device("cpu"))
    assert seen == [(steering, config)]


@pytest.mark.vllm
def test_a_tensor_parallel_worker_without_the_bank_plans_and_mixes_as_rank_0():
    """Rank 0 owns the bank and shares ŷ; rank 1 keeps only a slot ledger, yet builds the same plan
    every step (slots, a full bank, an eviction, a release), mixes the same logits, and keeps no
    records."""
    from esamp.core.config import EsampConfig, Filters, Steering
    from esamp.core.distiller import DistillerBank, SlotLedger
    from esamp.engines.vllm.rows import RequestRow
    from esamp.engines.vllm.steering import EngineSteering
    from esamp.engines.vllm.tp import TensorParallel

    H, V = 16, 48
    wire = _Wire()
    workers = [
        EngineSteering(
            EsampConfig(slots=2, rank=4),
            hidden=H,
            vocab=V,
            max_rows=8,
            device=torch.device("cpu"),
            tp=TensorParallel(rank, 2, wire.end(rank)),
        )
        for rank in (0, 1)
    ]
    owner, follower = workers
    assert isinstance(owner.slots, DistillerBank) and follower.bank is None
    assert type(follower.slots) is SlotLedger and follower.slots.capacity == 2
    head = torch.randn(V, H)
    torch.manual_seed(0)

    def row(group, sample, n=2):
        return RequestRow(
            group,
            sample,
            Steering(beta=1.0),
            Filters(temperature=1.0, top_p=0.9, min_p=0.0),
            [0] * sample,
            records=True,
            n=n,
        )

    batches = [
        {0: row("a", 0), 1: row("a", 1), 2: row("b", 0, 1)},
        {0: row("a", 0), 1: row("b", 0, 1), 2: row("c", 0, 1)},  # bank full: c is sampled plainly
        {0: row("c", 0, 1), 1: row("d", 0, 1)},
    ]  # a and b idle: c and d evict them
    for step, rows in enumerate(batches):
        if step == 2:
            assert owner.release("b") and follower.release("b")
        plans, outs = lockstep(workers, rows, head, H, V)
        assert [p.groups for p in plans] == [plans[0].groups] * 2 and plans[0].steered
        assert plans[0].step.layout.slots == plans[1].step.layout.slots
        assert torch.equal(outs[0], outs[1]), step
        assert owner.slots.groups == follower.slots.groups
    assert owner.slots.groups == {"c": 1, "d": 0}  # c took b's released slot, d evicted idle a
    assert owner.counters["bank_full"] == follower.counters["bank_full"] == 1
    assert owner.counters["slots_evicted"] == follower.counters["slots_evicted"] == 1
    assert owner.counters["port_hits"] == follower.counters["port_hits"] > 0
    assert owner.drain()["steps"] and follower.drain()["steps"] == []  # records: rank 0's only
    assert follower.metrics()["train_steps"] == 0 < owner.metrics()["train_steps"]


def test_tensor_parallel_workers_get_the_v1_runner_and_their_share_of_a_cpu():
    from esamp.engines.vllm.launch import parallel_env

    assert parallel_env(1, cuda=False, environ={}) == {}
    assert parallel_env(2, cuda=True, environ={}) == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    cpu = parallel_env(3, cuda=False, environ={})
    assert cpu["VLLM_USE_V2_MODEL_RUNNER"] == "0" and cpu["VLLM_CPU_KVCACHE_SPACE"] == "1"  # 4 GiB over 3
    assert int(cpu["OMP_NUM_THREADS"]) >= 1
    # what the operator set stands (esamp's own 4 GiB default is split either way)
    given = {"VLLM_USE_V2_MODEL_RUNNER": "1", "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "3"}
    assert parallel_env(3, cuda=False, environ=given) == {}
    assert "OMP_NUM_THREADS" not in parallel_env(3, cuda=False, environ={"VLLM_CPU_OMP_THREADS_BIND": "auto"})


def test_on_a_gpu_vllm_starts_its_processes_with_spawn_unless_told_otherwise():
    """A process that asked the CUDA driver anything cannot fork a CUDA child (the eval's embedder
    does, through sentence-transformers); spawn is the default on a GPU, the operator's choice stands."""
    from esamp.engines.vllm.launch import START_ENV, cuda_env

    assert cuda_env(environ={}) == {START_ENV: "spawn"}
    assert cuda_env(environ={START_ENV: "fork"}) == {}


def test_the_engine_context_is_the_default_or_the_models_own_when_shorter():
    """A model built for 2,048 positions gets 2,048 (vLLM refuses more); a longer one the default."""
    from esamp.engines.vllm.launch import MAX_MODEL_LEN, ModelFacts, context

    def facts(config):
        return ModelFacts("m", {}, None, config, False)

    assert context(facts({"max_position_embeddings": 2048})) == 2048
    assert context(facts({"max_position_embeddings": 32768})) == MAX_MODEL_LEN
    assert context(facts({})) == MAX_MODEL_LEN
    assert context(facts({"max_position_embeddings": 2048}), 512) == 512


@pytest.mark.vllm
def test_the_model_classes_pickle_by_name():
    """vLLM saves its torch.compile artifact with the compiled model's class; a class named inside
    a function cannot be pickled, so the save failed ("unable to save AOT compiled function") and
    every start of Gemma 3 compiled again. Each of our classes, the tapped inner model's forward
    included, pickles by reference to this module."""
    import pickle

    from esamp.engines.vllm import model

    inner = model._TappedGemma3Model
    for obj in (
        model.EsampLlamaForCausalLM,
        model.EsampQwen2ForCausalLM,
        model.EsampGemma3ForCausalLM,
        inner,
        inner.forward,
        model._Gemma3WithTaps,
    ):
        assert "<locals>" not in obj.__qualname__
        assert pickle.loads(pickle.dumps(obj)) is obj


def test_closing_an_engine_shuts_its_core_down_and_frees_cached_memory(monkeypatch):
    """An in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0) froze the GC heap at its start;
    only its own shutdown unfreezes it, so close() must call it or the GPU memory stays taken."""
    import types

    from esamp.engines.vllm import engine as vllm_engine

    calls = []
    core = types.SimpleNamespace(shutdown=lambda: calls.append("shutdown"))
    engine = vllm_engine.VllmEngine.__new__(vllm_engine.VllmEngine)
    engine.llm = object()
    engine.engine = types.SimpleNamespace(engine_core=core)
    engine.drain = lambda: calls.append("drain")
    engine._channel = types.SimpleNamespace(close=lambda: calls.append("records channel closed"))
    monkeypatch.setattr(vllm_engine, "_release_cached_gpu_memory", lambda: calls.append("released"))
    engine._shutdown()
    assert calls == ["drain", "records channel closed", "shutdown", "released"] and engine.llm is None
    assert engine._channel is None


def test_records_are_fetched_every_few_engine_steps_while_vllm_is_busy():
    """A record fetch is a round trip that waits for the engine process to finish a step: while
    vLLM is busy the library engine fetches every DRAIN_STEPS steps, within the time bounds."""
    from esamp.engines.vllm import engine as ve

    e = object.__new__(ve.VllmEngine)
    e._batches_since_drain = ve.DRAIN_STEPS - 1
    assert not e.drain_due(ve.DRAIN_MIN_SECONDS) and not e.drain_due(0.9 * ve.DRAIN_MAX_SECONDS)
    assert e.drain_due(ve.DRAIN_MAX_SECONDS)  # slow steps: novelty never waits longer than this
    e._batches_since_drain = ve.DRAIN_STEPS
    assert not e.drain_due(0.9 * ve.DRAIN_MIN_SECONDS) and e.drain_due(ve.DRAIN_MIN_SECONDS)


def test_records_are_fetched_only_while_some_are_owed(monkeypatch):
    """A fetch is answered by a thread of the engine's process, which takes its interpreter from
    the steps: none while the prompts prefill (no output yet), one as soon as a step brings no
    output while records are owed, none again once a fetch found every record back, and a group's
    release always goes at once. Whether every record is back reaches the groups either way. A
    fetch made when vLLM brought nothing lets the worker wait for the copies in flight (a run's
    last records come in one fetch); one made while outputs come does not wait."""
    import types

    from esamp.engines.vllm import engine as ve

    monkeypatch.setattr(ve.time, "sleep", lambda s: None)
    e = object.__new__(ve.VllmEngine)
    outputs: list = []
    pending = [0]
    e.engine = types.SimpleNamespace(step=lambda: list(outputs), has_unfinished_requests=lambda: True)
    e.by_request, e._admitted, e.first_token_seconds, e.release = {}, {}, [], []
    e.groups = {"g": types.SimpleNamespace(steered=True)}
    e._last_drain, e._batches_since_drain, e._records_owed = 0.0, 0, False
    fetched, seen, waits = [], [], []

    def drain(wait=0.0):
        fetched.append(len(outputs))
        waits.append(wait)
        return {"steps": [], "pending": pending[0]}

    e.drain = drain
    e._advance_groups = lambda advance, stats: advance(None)
    e._advance = lambda g, all_back: seen.append(all_back) or []
    for _ in range(5):  # prefilling: nothing to fetch, and nothing is owed
        e.step()
    assert fetched == [] and seen == [True] * 5
    outputs.append(types.SimpleNamespace(request_id="elsewhere", outputs=[], finished=False))
    e._last_drain = ve.time.perf_counter()
    e.step()  # an output: its record is owed, but a fetch waits for DRAIN_STEPS steps or time
    assert fetched == [] and seen[-1] is False
    outputs.clear()
    pending[0] = 1
    e.step()  # no output: fetch now; one record still on its way from the device
    e.step()  # ... so again
    pending[0] = 0
    e.step()  # every record back
    e.step()
    e.step()  # nothing owed: no fetch
    assert fetched == [0, 0, 0] and seen[-5:] == [False, False, True, True, True]
    assert waits == [ve.DRAIN_WAIT_SECONDS] * 3
    e.release.append("g")
    e.step()  # a released group is handed back at once
    assert len(fetched) == 4
    outputs.append(types.SimpleNamespace(request_id="elsewhere", outputs=[], finished=False))
    e._batches_since_drain, e._last_drain = ve.DRAIN_STEPS, 0.0
    e.step()  # due while vLLM is busy: the fetch takes what is back, without waiting
    assert len(fetched) == 5 and waits[-1] == 0.0


def test_the_cpu_scheduling_follows_the_context_and_yields_to_the_caller(monkeypatch):
    """``launch.scheduling``: on a CPU every prompt prefilled whole, in a step budget that holds the
    context (vLLM refuses a budget below it then), the context a caller's ``llm_kwargs`` give
    included; a caller's own scheduling stands; a GPU keeps vLLM's."""
    pytest.importorskip("vllm")
    import vllm

    from esamp.engines.vllm import launch
    from esamp.engines.vllm.engine import VllmEngine

    assert launch.scheduling(1024, cuda=True) == {}
    assert launch.scheduling(1024, cuda=False) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}
    assert set(launch.scheduling(1, cuda=False)) == launch.SCHEDULING

    class Started(Exception):
        pass

    def fake_llm(**kwargs):
        raise Started(kwargs)

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    monkeypatch.setattr("esamp.engines.vllm.engine.cuda_available", lambda: False)  # a CPU, on a GPU machine too
    monkeypatch.setattr(os, "environ", os.environ.copy())  # what a CPU start sets stays in this test

    def engine_kwargs(**given):
        with pytest.raises(Started) as started:
            VllmEngine("qwen2.5-0.5b:dummy", plain=True, **given)
        return started.value.args[0]

    assert engine_kwargs()["max_num_batched_tokens"] == 4096 and not engine_kwargs()["enable_chunked_prefill"]
    assert engine_kwargs(llm_kwargs={"max_model_len": 16384})["max_num_batched_tokens"] == 16384
    own = engine_kwargs(llm_kwargs={"enable_chunked_prefill": True})
    assert own["enable_chunked_prefill"] and "max_num_batched_tokens" not in own


def test_the_runner_is_named_from_the_workers_flag_or_where_its_class_lives():
    """``runner_name``: vLLM's own flag on the worker where it has one; else Model Runner V2 is
    the runner whose class lives in ``vllm.v1.worker.gpu`` (what ``esamp bench`` reports per side)."""
    from esamp.engines.vllm.extension import runner_name

    def runner_in(module: str):
        return type("GPUModelRunner", (), {"__module__": module})()

    assert runner_name(SimpleNamespace(use_v2_model_runner=True, model_runner=object())) == "MRV2"
    assert runner_name(SimpleNamespace(use_v2_model_runner=False, model_runner=object())) == "V1"
    assert runner_name(SimpleNamespace(model_runner=runner_in("vllm.v1.worker.gpu.model_runner"))) == "MRV2"
    assert runner_name(SimpleNamespace(model_runner=runner_in("vllm.v1.worker.gpu_model_runner"))) == "V1"
    assert runner_name(SimpleNamespace(model_runner=runner_in("vllm.v1.worker.cpu_model_runner"))) == "V1"


def test_an_hf_models_dtype_is_float32_on_a_cpu_without_bf16_arithmetic(monkeypatch, tmp_path):
    """``launch.default_dtype``: bf16 on a GPU and on a CPU whose flags name bf16 arithmetic
    (x86's AVX512-BF16 or AMX, Arm's BF16), float32 on any other CPU (vllm-cpu ran 2.4x faster so
    on an AVX2 machine); a dtype given stands, and a GGUF read natively keeps float16."""
    from esamp.engines.models import resolve
    from esamp.engines.vllm import launch

    assert launch.cpu_bf16("processor : 0\nflags : fpu sse2 avx2 avx512f avx512_bf16\n")
    assert launch.cpu_bf16("processor : 0\nflags : fpu amx_bf16 amx_tile\n")
    assert launch.cpu_bf16("processor : 0\nFeatures : fp asimd bf16 i8mm\n")  # Arm
    assert not launch.cpu_bf16("processor : 0\nflags : fpu sse2 avx2 fma\n")
    assert not launch.cpu_bf16("")  # nothing to read: no bf16 assumed
    monkeypatch.setenv("ESAMP_CACHE_DIR", str(tmp_path))
    preset = resolve("qwen2.5-0.5b:dummy")
    for has_bf16, cpu_dtype in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(launch, "cpu_bf16", lambda cpuinfo=None, v=has_bf16: v)
        assert launch.default_dtype(cuda=True) == "bfloat16"
        assert launch.default_dtype(cuda=False) == cpu_dtype
        assert launch.model_facts(preset, cuda=False).load["dtype"] == cpu_dtype
        assert launch.model_facts(preset, cuda=True).load["dtype"] == "bfloat16"
        assert launch.model_facts(preset, cuda=False, dtype="float16").load["dtype"] == "float16"


def test_d_comes_as_its_factors_only_where_the_filters_keep_few_candidates():
    """A plan leaves d = W·ŷ as ŷ and the head (computed at the candidates) only when every steered
    row has min-p or a top-k within the candidates the kernels list one by one; a row with neither
    (every token may be a candidate) makes the step take the full product. Both forms of d give
    the same mixed logits."""
    from esamp.core.backends.triton_filter import CANDIDATES
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm.rows import RequestRow
    from esamp.engines.vllm.steering import EngineSteering

    H, V = 16, 48
    steering = EngineSteering(EsampConfig(slots=4, rank=4), hidden=H, vocab=V, max_rows=8, device=torch.device("cpu"))

    def rows(**filters):
        return {
            i: RequestRow("g", i, Steering(beta=0.8), Filters(temperature=1.0, **filters), [0] * i, records=True, n=2)
            for i in range(2)
        }

    assert steering.plan(rows(min_p=0.1), 2).few_candidates
    assert steering.plan(rows(min_p=0.0, top_k=40), 2).few_candidates
    assert not steering.plan(rows(min_p=0.0, top_k=CANDIDATES + 1), 2).few_candidates
    assert not steering.plan(rows(min_p=0.0, top_k=0, top_p=0.9), 2).few_candidates

    torch.manual_seed(0)
    plan = steering.plan(rows(min_p=0.05, top_p=0.9), 2)
    head = torch.randn(V + 3, H)  # a padded vocabulary: rows past V are never read
    assert steering.keep_taps(torch.randn(2, 2 * H))
    handoff = steering.distill(plan, 0, 1, None, torch.float32)
    logits = torch.randn(2, V) * 3
    outs = []
    for d in (iv.HeadProduct(handoff.prediction[:2], head), handoff.prediction[:2] @ head[:V].t()):
        handoff.d = d
        outs.append(steering.apply(plan, logits.clone(), handoff))
    torch.testing.assert_close(outs[0], outs[1])
    assert torch.isfinite(outs[0]).any() and not torch.equal(outs[0], logits)


def test_the_heap_stays_frozen_while_an_engine_is_open_and_thaws_when_the_last_closes(monkeypatch):
    """An engine's start freezes what lives then out of the garbage collector (a full collection
    over a client of two engines took about 0.27 s, a pause of its outputs); closing one engine
    collects what it left in reference cycles, and the heap stays frozen while another is open."""
    import gc
    import weakref

    from esamp.engines.vllm import engine as module

    class Held:  # something an engine holds in a reference cycle (a weak reference tells its end)
        pass

    monkeypatch.setattr(module, "_open_engines", 0)
    gc.unfreeze()
    try:
        first = Held()
        first.cycle = first
        gone = weakref.ref(first)
        module._freeze_heap()  # the first engine
        module._freeze_heap()  # a second one, beside it
        assert gc.get_freeze_count() > 0
        del first
        gc.collect()
        assert gone() is not None  # frozen: not even a full collection looks at it
        module._thaw_heap()  # one closes: what it left is collected, the rest frozen again
        assert gone() is None and gc.get_freeze_count() > 0
        module._thaw_heap()  # the last closes
        assert gc.get_freeze_count() == 0 and module._open_engines == 0
    finally:
        gc.unfreeze()


@pytest.mark.parametrize(
    "name, function, choices, typo",
    [
        ("ESAMP_UPDATE", "update_way", "auto, beside, inline", "in-line"),
        ("ESAMP_MIX_STREAM", "mix_stream", "priority, current", "high"),
    ],
)
def test_the_steerings_environment_choices_take_theirs_and_name_them_for_any_other(
    monkeypatch, name, function, choices, typo
):
    """ESAMP_UPDATE picks where the Distiller's update runs, ESAMP_MIX_STREAM where the filter and
    mix of a step with its update beside replays (the CPU has no streams: no lane); the steering's
    metrics (a bench's JSON) say which. Unset, each is its first choice; a value it does not know (a
    typo that would have meant the default) stops the engine's steering at its start, naming the
    ones it takes."""
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm import steering

    def start():
        return steering.EngineSteering(
            EsampConfig(slots=2, rank=4), hidden=8, vocab=16, max_rows=4, device=torch.device("cpu")
        )

    read = getattr(steering, function)
    monkeypatch.delenv(name, raising=False)
    assert read() == choices.split(", ")[0] == start().metrics()[function]
    for value in choices.split(", "):
        monkeypatch.setenv(name, value)
        assert read() == value
        engine = start()
        assert engine.mix_lane is None and engine.metrics()[function] == value
    monkeypatch.setenv(name, typo)
    words = f"{name} must be one of {choices}, not '{typo}': unset it for the default"
    with pytest.raises(ValueError, match=words):
        read()
    with pytest.raises(ValueError, match=words):
        start()
