"""The MRV2 adapter driven through vLLM's own MRV2 interface classes (``LogitsProcRequestState``,
``LogitsContext``, CPU tensors), beside the V1 adapter driven through ``BatchUpdate`` on the same
requests, each in an engine of its own (two configurations: two exchanges, two Distiller banks
with the same initial weights) with a small stand-in model that hands the exchange its taps as
``model.py`` does: the V1 adapter steers through ``put_taps``, the MRV2 one through the late
path (``put_taps_late``, then ``late_taps`` and ``step_late`` in its ``apply``). Rows are reordered and slots
recycled between steps. No running MRV2 engine is within reach (vLLM's MRV2 needs Triton with
a driver; docs/vllm.md).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from _vllm_helpers import HAS_MRV2_PROCESSORS, require_vllm

pytestmark = [pytest.mark.vllm]

if not HAS_MRV2_PROCESSORS:
    pytest.skip("MRV2 logits-processor interface: vLLM >= 0.31", allow_module_level=True)

V, H, SLOTS, LAYERS = 64, 8, 8, 4


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require_vllm()


def _config(esamp: bool = True, **engine):
    """A VllmConfig's shape (takes weak references, is not hashable): each call is another engine."""
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm import settings as es

    class Config:
        __hash__ = None
        model_config = SimpleNamespace(get_vocab_size=lambda: V, get_hidden_size=lambda: H, logits_processors=None)
        scheduler_config = SimpleNamespace(max_num_seqs=SLOTS)
        parallel_config = SimpleNamespace(enable_batch_sharded_sampling=False)
        speculative_config = None
        additional_config = {es.KEY: es.engine_settings(EsampConfig(rank=4, lr=0.05, slots=4), LAYERS)} if esamp else {}

    config = Config()
    for name, value in engine.items():
        setattr(config, name, value)
    return config


class _Model:
    """Stands in for ``model.EsampLlamaForCausalLM.compute_logits`` with a non-plain head: the
    exchange's calls in the same order, d from the dense head."""

    def __init__(self, config, head: torch.Tensor) -> None:
        from esamp.engines.vllm.exchange import exchange_for

        self.head = head
        self.exchange = exchange_for(config)
        self.exchange.attach_model(self)

    def esamp_lm_head(self) -> torch.Tensor:
        return self.head

    def esamp_dense_weight(self) -> None:
        return None  # (a head that post-processes its logits: no dense weight of its own)

    @staticmethod
    def norms(source, target):
        return torch.nn.functional.rms_norm(source, (H,)), torch.nn.functional.rms_norm(target, (H,))

    def compute_logits(self, aux: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        x = self.exchange
        plan = x.begin(aux.shape[0])
        if plan is None:
            x.warm_up(aux, 0, 1, self.norms, torch.float32)
            x.put_taps_late(aux, 0, 1, self.norms, torch.float32)
            return logits
        prediction = x.put_taps(plan, aux, 0, 1, self.norms, torch.float32)
        x.put_distiller_logits(plan, prediction.to(self.head.dtype) @ self.head[:V].t())
        return logits


def _rstate(prompt_len: np.ndarray):
    """vLLM's own MRV2 request state over CPU stand-ins for the runner's buffers."""
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState

    return LogitsProcRequestState(
        device=torch.device("cpu"),
        max_num_reqs=SLOTS,
        vocab_size=V,
        all_token_ids=None,
        prompt_len=SimpleNamespace(np=prompt_len),
        prefill_len=None,
        total_len=None,
    )


def _ctx(slots: list[int], seq_lens: list[int]):
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

    mapping = torch.tensor(slots, dtype=torch.int64)
    return LogitsContext(
        expanded_idx_mapping=mapping,
        idx_mapping=mapping,
        idx_mapping_np=np.array(slots, dtype=np.intp),
        expanded_local_pos=torch.zeros(len(slots), dtype=torch.int32),
        input_ids=torch.zeros(len(slots), dtype=torch.int32),
        pos=torch.tensor(seq_lens, dtype=torch.int64) - 1,
        seq_lens_upper_bound_np=np.array(seq_lens, dtype=np.int32),
    )


def _request(group: str, sample: int, n: int, **filters):
    from vllm import SamplingParams

    from esamp.core.config import Steering
    from esamp.engines.vllm import settings as es

    # As the library engine: one request per sample, n=1 each (the payload records the params' n,
    # as it always has; ``n`` names the group's size for the reader).
    params = SamplingParams(n=1, max_tokens=8, **filters)
    es.prepare(params, settings=es.request_settings(group, sample, Steering()))
    return params


class _V1Engine:
    """The V1 adapter as vLLM's V1 runner drives it: a ``BatchUpdate`` per step (rows that changed
    added, rows past the batch removed), the model's ``compute_logits``, then ``apply``."""

    def __init__(self, config, head) -> None:
        from esamp.engines.vllm.entry import EsampLogitsProcessor

        self.adapter = EsampLogitsProcessor(config, torch.device("cpu"), False)  # as vLLM's V1 loader builds it
        self.model = _Model(config, head)
        self.rows: dict[int, str] = {}

    def step(self, order, requests, outputs, aux, raw):
        from vllm.v1.sample.logits_processor import BatchUpdate

        now = dict(enumerate(order))
        added = [(i, requests[n], None, outputs[n]) for i, n in now.items() if self.rows.get(i) != n]
        removed = [i for i in self.rows if i >= len(order)]
        self.rows = now
        self.adapter.update_state(BatchUpdate(batch_size=len(order), removed=removed, added=added, moved=[]))
        logits = self.model.compute_logits(torch.stack([aux[n] for n in order]), torch.stack([raw[n] for n in order]))
        return self.adapter.apply(logits)


class _Mrv2Engine:
    """The MRV2 adapter as Model Runner V2 drives it: ``add_request`` when a request takes a slot,
    the model's ``compute_logits``, then ``apply`` with the step's ``LogitsContext``."""

    def __init__(self, config, head, processor=None) -> None:
        from esamp.engines.vllm.entry import EsampLogitsProcessor

        self.prompt_len = np.zeros(SLOTS, dtype=np.int32)
        # as MRV2's loader builds it
        self.adapter = (processor or EsampLogitsProcessor)(config, _rstate(self.prompt_len))
        self.model = _Model(config, head)

    def add(self, slot: int, params, prompt_len: int) -> bool:
        self.prompt_len[slot] = prompt_len  # the runner's request state first, then the sampler's processors
        return self.adapter.add_request(slot, params)

    def step(self, order, slot_of, seq_lens, aux, raw):
        logits = self.model.compute_logits(torch.stack([aux[n] for n in order]), torch.stack([raw[n] for n in order]))
        return self.adapter.apply(logits, _ctx([slot_of[n] for n in order], [seq_lens[n] for n in order]))


def _records(steering):
    return [{k: v for k, v in rec.items() if k != "time"} for rec in steering.drain()["steps"]]


def test_mrv2_adapter_steers_like_the_v1_adapter_with_rows_reordered_and_slots_recycled():
    from vllm import SamplingParams

    from esamp.engines.vllm.mrv2 import Mrv2Adapter
    from esamp.engines.vllm.v1 import V1Adapter

    head = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        v1, v2 = _V1Engine(_config(), head), _Mrv2Engine(_config(), head)
    assert type(v1.adapter) is V1Adapter and type(v2.adapter) is Mrv2Adapter
    assert not v1.model.exchange.late and v2.model.exchange.late
    assert v1.adapter.steering is not v2.adapter.steering  # two engines, two banks

    requests = {
        "a0": _request("ga", 0, 2, temperature=0.7, top_p=0.9),
        "a1": _request("ga", 1, 2, temperature=0.7, top_p=0.9),
        "b0": _request("gb", 0, 1, temperature=1.0, top_k=5, min_p=0.1),
        "plain": SamplingParams(n=1, temperature=0.8, top_p=0.5),  # not ESamp's: vLLM filters it
        "c0": _request("gc", 0, 1, temperature=0.0),  # greedy
        "d0": _request("gd", 0, 1, temperature=0.9, top_k=7),
        "plain2": SamplingParams(n=1, temperature=1.0),
    }
    prompt = {"a0": 5, "a1": 5, "b0": 3, "plain": 4, "c0": 2, "d0": 6, "plain2": 3}
    # each step's batch (V1 and MRV2 see the same row order: the steered logits must be equal);
    # which requests take a slot before it (MRV2 has no remove call: c0 takes the slot b0 left,
    # plain2 the one a1 left, d0 the one plain left)
    steps = [
        (["b0", "plain", "a1", "a0"], {"a0": 3, "a1": 0, "b0": 5, "plain": 1}),
        (["a0", "b0", "a1", "plain"], {}),
        (["c0", "a1", "plain", "a0"], {"c0": 5}),
        (["plain", "c0", "a0"], {}),
        (["a0", "plain2", "d0", "c0"], {"plain2": 0, "d0": 1}),
        (["d0", "a0", "plain2", "c0"], {}),
    ]
    slot_of: dict[str, int] = {}
    outputs = {n: [] for n in requests}  # V1's live lists of generated ids
    gen = torch.Generator().manual_seed(0)
    steered_rows = 0
    for step, (order, arrivals) in enumerate(steps):
        for name, slot in arrivals.items():
            slot_of[name] = slot
            assert v2.add(slot, requests[name], prompt[name]) is (not name.startswith("plain"))
        aux = {n: torch.randn(2 * H, generator=gen) for n in requests}
        raw = {n: 3 * torch.randn(V, generator=gen) for n in requests}
        seq_lens = {n: prompt[n] + len(outputs[n]) for n in requests}
        with torch.inference_mode():
            got_v1 = v1.step(order, requests, outputs, aux, raw)
            got_v2 = v2.step(order, slot_of, seq_lens, aux, raw)
        assert torch.equal(got_v2, got_v1), step
        for i, name in enumerate(order):
            if name.startswith("plain"):
                assert torch.equal(got_v2[i], raw[name]), (step, name)  # left to vLLM's own filters
            else:
                steered_rows += 1
                row = v2.adapter.slots[slot_of[name]]
                assert row.group == "g" + name[0]  # never a recycled slot's previous group
            if name == "b0":
                assert int(torch.isfinite(got_v2[i]).sum()) <= 5  # its own top-k, applied by ESamp
        for name in order:
            outputs[name].append(1)
    s1, s2 = v1.adapter.steering, v2.adapter.steering
    assert s2.counters["taps_missing"] == s1.counters["taps_missing"] == 0
    assert s2.counters["port_hits"] == s1.counters["port_hits"] == steered_rows
    assert s2.counters["train_steps"] == s1.counters["train_steps"] == len(steps)
    assert s2.counters["plan_builds"] == s1.counters["plan_builds"] == len(steps)  # every step here changes the rows
    records = _records(s2)
    assert records == _records(s1)  # generation indices included: MRV2's from seq_lens - prompt_len
    assert [r["step"] for r in records] == list(range(1, len(steps) + 1))
    assert {(g, s, k) for r in records for g, s, k, _, _ in r["rows"] if g == "gc"} == {
        ("gc", 0, 0),
        ("gc", 0, 1),
        ("gc", 0, 2),
        ("gc", 0, 3),
    }
    assert not any(g == "gb" for r in records[2:] for g, *_ in r["rows"])  # b0's slot is c0's from step 3
    assert all(r["loss"] and all(np.isfinite(v) for v in r["loss"].values()) for r in records)
    assert records[0]["loss"].keys() == {"ga", "gb"} and records[-1]["loss"].keys() == {"ga", "gc", "gd"}


def test_the_tests_tracing_processor_steps_and_traces_on_mrv2():
    """The tracing processor the engine tests run (``_tracing``), built as MRV2's loader builds it,
    steps and traces: its steering takes what the MRV2 adapter hands ``EngineSteering.apply``. (When
    the adapter began to pass the time its ``apply`` started, every traced engine would have stopped
    at its first steered step on a GPU, the only place MRV2 runs.)"""
    import _tracing

    head = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    engine = _Mrv2Engine(_config(), head, processor=_tracing.TracingProcessor)
    steering = engine.adapter.steering
    assert isinstance(steering, _tracing.TracingSteering)
    requests = {"a0": _request("ga", 0, 2), "a1": _request("ga", 1, 2)}
    slot_of = {"a0": 0, "a1": 3}
    for name, slot in slot_of.items():
        engine.add(slot, requests[name], 4)
    gen = torch.Generator().manual_seed(0)
    _tracing.TracingSteering.traces.clear()
    for lens in (4, 5):
        aux = {n: torch.randn(2 * H, generator=gen) for n in requests}
        raw = {n: 3 * torch.randn(V, generator=gen) for n in requests}
        with torch.inference_mode():
            engine.step(["a1", "a0"], slot_of, dict.fromkeys(requests, lens), aux, raw)
    traces = _tracing.TracingSteering.traces
    assert [t["meta"] for t in traces] == [[("ga", 1, 0), ("ga", 0, 0)], [("ga", 1, 1), ("ga", 0, 1)]]
    assert all(t["steered"].shape == (2, V) and t["distiller_logits"].shape == (2, V) for t in traces)
    traces.clear()


def test_the_plan_is_rebuilt_only_when_the_row_order_or_a_slot_changes():
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    engine = _Mrv2Engine(_config(), head)
    steering = engine.adapter.steering
    requests = {"a0": _request("ga", 0, 1), "b0": _request("gb", 0, 1)}
    slot_of = {"a0": 2, "b0": 6}
    for name, slot in slot_of.items():
        engine.add(slot, requests[name], 3)
    gen = torch.Generator().manual_seed(0)

    def step(order, lens=3):
        aux = {n: torch.randn(2 * H, generator=gen) for n in requests}
        raw = {n: torch.randn(V, generator=gen) for n in requests}
        with torch.inference_mode():
            engine.step(order, slot_of, dict.fromkeys(requests, lens), aux, raw)

    step(["a0", "b0"])
    step(["a0", "b0"], lens=4)
    assert steering.counters["plan_builds"] == 1
    step(["b0", "a0"])
    assert steering.counters["plan_builds"] == 2
    engine.add(6, _request("gc", 0, 1), 2)  # a new request in a slot of the same order
    step(["b0", "a0"])
    assert steering.counters["plan_builds"] == 3
    assert steering.drain()["steps"][-1]["rows"][0][0] == "gc"
    assert steering.release("gc") and 6 not in engine.adapter.slots  # the client ended it: its row goes
    step(["b0", "a0"])
    assert steering.counters["plan_builds"] == 4 and steering.counters["taps_missing"] == 0


def test_a_slow_step_is_kept_with_where_its_host_time_went(monkeypatch):
    """The MRV2 adapter's whole ``apply`` is the step's host time (its bookkeeping, the plan, the
    Distiller step, the filter and mix, the record), and a step past ``SLOW_STEP_S`` is kept in
    ``metrics()["slow_steps"]`` split into those parts, the plan only on the step that built one."""
    from esamp.engines.vllm import steering as st

    monkeypatch.setattr(st, "SLOW_STEP_S", 0.0)  # every step is "slow": each is kept
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    engine = _Mrv2Engine(_config(), head)
    steering = engine.adapter.steering
    requests = {"a0": _request("ga", 0, 1), "b0": _request("gb", 0, 1)}
    slot_of = {"a0": 2, "b0": 6}
    for name, slot in slot_of.items():
        engine.add(slot, requests[name], 3)
    gen = torch.Generator().manual_seed(0)
    for lens in (3, 4, 5):
        aux = {n: torch.randn(2 * H, generator=gen) for n in requests}
        raw = {n: torch.randn(V, generator=gen) for n in requests}
        with torch.inference_mode():
            engine.step(["a0", "b0"], slot_of, dict.fromkeys(requests, lens), aux, raw)
    metrics = steering.metrics()
    slow = metrics["slow_steps"]
    assert [s["step"] for s in slow] == [1, 2, 3]
    assert [s["plan_ms"] > 0 for s in slow] == [True, False, False]  # one plan, built for the first step
    built = slow[0]  # where the plan's time went: its rows, its build (of it, the buffers' copy)
    # (each figure rounded to 1 µs on its own: sums compared within the roundings)
    assert built["plan_rows_ms"] + built["plan_build_ms"] <= built["plan_ms"] + 2e-3
    assert 0 <= built["plan_write_ms"] <= built["plan_build_ms"] + 2e-3 and built["plan_cpu_ms"] > 0
    assert not any("plan_rows_ms" in s for s in slow[1:])
    for s in slow:
        # the thread's CPU time, another clock than host_ms's: on a virtual machine it ran 7% ahead
        # of the wall clock over one step in CI (1.237 ms against 1.151), so it bounds nothing here
        assert s["cpu_ms"] > 0
        assert (s["rows"], s["steered"], s["mix"], s["distiller"]) == (2, 2, "eager", "eager")  # a CPU: no graphs
        assert s["host_ms"] >= s["plan_ms"] + s["distill_ms"] + s["mix_ms"] + s["records_ms"] - 3e-3
        assert s["distill_ms"] > 0 and s["mix_ms"] > 0
    # the host time counted is every step's whole apply (within the rounding of each to 1 µs)
    assert metrics["host_ms"] == pytest.approx(sum(s["host_ms"] for s in slow), abs=0.1)
    assert metrics["host_ms"] >= metrics["plan_ms"]
    monkeypatch.setattr(st, "SLOW_STEP_S", 10.0)
    with torch.inference_mode():
        engine.step(["a0", "b0"], slot_of, dict.fromkeys(requests, 6), aux, raw)
    assert len(steering.metrics()["slow_steps"]) == 3  # a fast step is not kept


def test_mrv2_adapter_skips_plain_requests_and_only_the_live_adapter_works():
    from vllm import SamplingParams

    from esamp.engines.vllm.entry import EsampLogitsProcessor

    config = _config()
    old = EsampLogitsProcessor(config, _rstate(np.zeros(SLOTS, dtype=np.int32)))
    built = EsampLogitsProcessor(config, _rstate(np.zeros(SLOTS, dtype=np.int32)))  # vLLM rebuilt it: this one works
    assert built.steering is old.steering
    assert old.add_request(1, _request("g", 0, 1)) is False and not old.has_rows()
    logits = torch.randn(2, V)
    assert old.apply(logits, _ctx([0, 1], [3, 3])) is logits

    assert built.add_request(0, SamplingParams(temperature=0.5)) is False
    assert not built.has_rows()
    assert built.apply(logits, _ctx([0, 1], [3, 3])) is logits  # nothing of ours: untouched
    assert built.add_request(1, _request("g", 0, 1)) is True and built.has_rows()
    assert built.add_request(1, SamplingParams()) is False and not built.has_rows()  # the slot's new occupant
    assert built.apply(logits, _ctx([0, 1], [3, 3])) is logits
    assert built.steering.step_no == 0


def test_an_engine_without_esamp_filters_esamp_requests_like_the_v1_adapter():
    head = torch.randn(V, H)
    v1, v2 = _V1Engine(_config(esamp=False), head), _Mrv2Engine(_config(esamp=False), head)
    assert v2.adapter.steering.bank is None
    params = _request("g", 0, 1, temperature=0.5, top_k=3)
    assert v2.add(4, params, 3) is True
    aux, raw = {"a": torch.randn(2 * H)}, {"a": torch.randn(V)}
    with torch.inference_mode():
        got_v1 = v1.step(["a"], {"a": params}, {"a": []}, aux, raw)
        got_v2 = v2.step(["a"], {"a": 4}, {"a": 3}, aux, raw)
    assert torch.equal(got_v1, got_v2) and int(torch.isfinite(got_v2).sum()) == 3
    assert v2.model.exchange.taps_put == 0  # no bank: the model keeps no taps


@pytest.mark.parametrize(
    "engine, words",
    [
        ({"speculative_config": SimpleNamespace(num_speculative_tokens=2)}, "speculative decoding"),
        ({"parallel_config": SimpleNamespace(enable_batch_sharded_sampling=True)}, "batch-sharded sampling"),
    ],
)
def test_mrv2_adapter_refuses_engines_it_cannot_steer(engine, words):
    from esamp.engines.vllm.entry import EsampLogitsProcessor

    with pytest.raises(ValueError, match=words):
        EsampLogitsProcessor(_config(**engine), _rstate(np.zeros(SLOTS, dtype=np.int32)))


def test_with_the_shared_distiller_the_mrv2_adapter_steers_like_the_v1_adapter():
    """The late path with every group on the shared Distiller (one unit per step): rows reordered
    and a slot recycled, the same steered logits and records as the V1 adapter, and each step's
    one loss recorded for every group that trained."""
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm import settings as es

    shared = {es.KEY: es.engine_settings(EsampConfig(rank=4, lr=0.05, slots=4, distiller="shared"), LAYERS)}
    head = torch.randn(V, H, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        v1 = _V1Engine(_config(additional_config=shared), head)
        v2 = _Mrv2Engine(_config(additional_config=shared), head)
    assert v1.adapter.steering.bank.shared and v2.adapter.steering.bank.shared
    requests = {
        "a0": _request("ga", 0, 2, temperature=0.7, top_p=0.9),
        "a1": _request("ga", 1, 2, temperature=0.7, top_p=0.9),
        "b0": _request("gb", 0, 1, temperature=1.0, min_p=0.1),
        "c0": _request("gc", 0, 1, temperature=0.9),
    }
    steps = [
        (["b0", "a1", "a0"], {"a0": 3, "a1": 0, "b0": 5}),
        (["a0", "b0", "a1"], {}),
        (["c0", "a1", "a0"], {"c0": 5}),
    ]  # c0 takes the slot b0 left
    slot_of: dict[str, int] = {}
    outputs = {n: [] for n in requests}
    gen = torch.Generator().manual_seed(0)
    for step, (order, arrivals) in enumerate(steps):
        for name, slot in arrivals.items():
            slot_of[name] = slot
            assert v2.add(slot, requests[name], 3)
        aux = {n: torch.randn(2 * H, generator=gen) for n in requests}
        raw = {n: 3 * torch.randn(V, generator=gen) for n in requests}
        with torch.inference_mode():
            got_v1 = v1.step(order, requests, outputs, aux, raw)
            got_v2 = v2.step(order, slot_of, {n: 3 + len(outputs[n]) for n in requests}, aux, raw)
        assert torch.equal(got_v2, got_v1), step
        for name in order:
            outputs[name].append(1)
    records = _records(v2.adapter.steering)
    assert records == _records(v1.adapter.steering)
    assert [sorted(r["loss"]) for r in records] == [["ga", "gb"], ["ga", "gb"], ["ga", "gc"]]
    assert all(len(set(r["loss"].values())) == 1 for r in records)  # one Distiller, one loss per step
    assert float(v2.adapter.steering.bank.store.steps[0]) == len(steps)


def test_the_tracing_processor_the_tests_name_loads_under_both_runners_loaders():
    """A processor an engine names must speak Model Runner V2's interface too: where MRV2 is the
    default (vLLM >= 0.31 on a GPU), its loader refuses a class of the V1 interface alone, and
    every test engine built with ``TRACER`` failed to start there. Both loaders take it, and each
    builds the tracing adapter of its own runner, which traces the engine's one steering."""
    from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_by_fqcns

    from esamp.engines.vllm.mrv2 import Mrv2Adapter
    from esamp.engines.vllm.v1 import V1Adapter

    from _tracing import TRACER, TracingSteering, _Tracing

    (v2_class,) = _load_v2_logitsprocs_by_fqcns([TRACER])
    (v1_class,) = _load_logitsprocs_by_fqcns([TRACER])
    assert v1_class is v2_class
    with torch.inference_mode():
        v2 = v2_class(_config(), _rstate(np.zeros(SLOTS, dtype=np.int32)))
        v1 = v1_class(_config(), torch.device("cpu"), False)
    assert isinstance(v2, Mrv2Adapter) and isinstance(v2, _Tracing) and isinstance(v2.steering, TracingSteering)
    assert isinstance(v1, V1Adapter) and isinstance(v1, _Tracing) and isinstance(v1.steering, TracingSteering)


def test_under_tensor_parallelism_every_mrv2_worker_mixes_what_one_worker_mixes(monkeypatch):
    """Two workers of one tensor-parallel engine on Model Runner V2, each with its own adapter,
    beside a one-worker engine on the same steps (rows reordered, a slot recycled): rank 0 runs
    the Distiller in ``apply`` and broadcasts ŷ, rank 1 receives it with no bank of its own, and
    both mix exactly what the one worker mixes (d from the whole head, which a worker holding one
    shard gathers once: the stand-in model gives it whole). Records are rank 0's only."""
    from esamp.engines.vllm import steering as st
    from esamp.engines.vllm.tp import TensorParallel

    from _vllm_helpers import Wire

    head = torch.randn(V, H, generator=torch.Generator().manual_seed(3))
    wire = Wire()
    workers = []
    for rank in (0, 1):
        monkeypatch.setattr(st, "tensor_parallel", lambda config, rank=rank: TensorParallel(rank, 2, wire.end(rank)))
        with torch.inference_mode():
            workers.append(_Mrv2Engine(_config(), head))
    monkeypatch.undo()
    with torch.inference_mode():
        alone = _Mrv2Engine(_config(), head)
    owner, follower = (w.adapter.steering for w in workers)
    assert owner.bank is not None and follower.bank is None and follower.slots is not None

    requests = {
        "a0": _request("ga", 0, 2, temperature=0.7, top_p=0.9),
        "a1": _request("ga", 1, 2, temperature=0.7, top_p=0.9),
        "b0": _request("gb", 0, 1, temperature=1.0, min_p=0.1),
        "c0": _request("gc", 0, 1, temperature=0.9, top_k=7),
    }
    prompt = {"a0": 5, "a1": 5, "b0": 3, "c0": 4}
    steps = [
        (["b0", "a1", "a0"], {"a0": 2, "a1": 0, "b0": 1}),
        (["a0", "b0", "a1"], {}),
        (["c0", "a1", "a0"], {"c0": 1}),  # c0 takes the slot b0 left
        (["a0", "c0", "a1"], {}),
    ]
    slot_of: dict[str, int] = {}
    made = {n: 0 for n in requests}
    gen = torch.Generator().manual_seed(0)
    for order, arrivals in steps:
        for name, slot in arrivals.items():
            slot_of[name] = slot
            assert all(e.add(slot, requests[name], prompt[name]) for e in (*workers, alone))
        aux = {n: torch.randn(2 * H, generator=gen) for n in requests}
        raw = {n: 3 * torch.randn(V, generator=gen) for n in requests}
        seq_lens = {n: prompt[n] + made[n] for n in requests}
        with torch.inference_mode():  # rank 0 first: its broadcast is on the wire for rank 1
            got = [e.step(order, slot_of, seq_lens, aux, raw) for e in (*workers, alone)]
        assert torch.equal(got[0], got[2]) and torch.equal(got[1], got[2])
        assert not torch.equal(got[2], torch.stack([raw[n] for n in order]))  # steered
        for name in order:
            made[name] += 1
    ref = alone.adapter.steering
    assert owner.counters["port_hits"] == follower.counters["port_hits"] == ref.counters["port_hits"] > 0
    assert _records(owner) == _records(ref) and follower.drain()["steps"] == []
    assert follower.counters["train_steps"] == 0 < owner.counters["train_steps"]
