"""The reference engine end to end on the embedded SmolLM2-135M (short runs)."""

import pytest
import torch

from esamp.core.config import EsampConfig, SamplingConfig, Steering
from esamp.engines.base import run
from esamp.errors import PromptError
from esamp.events import DoneEvent, StepEvent, TokenEvent

pytestmark = pytest.mark.slow
PROMPT = "Name a colour."


def _collect(engine, prompt=PROMPT, esamp=None, **sampling):
    sampling = SamplingConfig(**{"n": 4, "max_tokens": 16, **sampling})
    events = list(run(engine, prompt, sampling, (esamp or EsampConfig()).steering))
    tokens: dict[int, list[TokenEvent]] = {}
    for ev in events:
        if isinstance(ev, TokenEvent):
            tokens.setdefault(ev.sample, []).append(ev)
    return events, tokens


def test_stream_order_novelty_and_counters(reference_engine):
    events, tokens = _collect(reference_engine)
    done = [e for e in events if isinstance(e, DoneEvent)]
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert sorted(d.sample for d in done) == [0, 1, 2, 3]
    for d in done:
        seq = tokens.get(d.sample, [])
        assert [t.index for t in seq] == list(range(len(seq))) == list(range(d.tokens))
        last_token_pos = max((events.index(t) for t in seq), default=-1)
        assert events.index(d) > last_token_pos
        for t in seq[:-1]:
            assert t.novelty is not None and 0.0 <= t.novelty <= 1.0
        if d.finish_reason == "stop" and seq:  # the stop token was fed back: last token measured
            assert seq[-1].novelty is not None
    assert all(s.esamp for s in steps)
    assert all(s.loss is not None and s.loss > 0 for s in steps)
    assert sum(s.port_hits for s in steps) == 1 + sum(d.tokens for d in done) - sum(
        1 for d in done if d.finish_reason == "length"
    )
    assert any(s.candidates >= 1 for s in steps)
    assert reference_engine.bank.free_slots == reference_engine.bank.capacity


def test_beta_zero_equals_off_exactly(reference_engine):
    _, off = _collect(reference_engine, esamp=EsampConfig(enabled=False), seed=11, max_tokens=24)
    _, zero = _collect(reference_engine, esamp=EsampConfig(beta=0.0), seed=11, max_tokens=24)
    as_ids = lambda toks: {s: [t.token_id for t in seq] for s, seq in toks.items()}  # noqa: E731
    assert as_ids(off) == as_ids(zero)
    assert all(t.novelty is None for seq in off.values() for t in seq)


def test_esamp_moves_the_sampler(reference_engine):
    _, off = _collect(reference_engine, esamp=EsampConfig(enabled=False), seed=5, max_tokens=24, n=4)
    _, on = _collect(reference_engine, esamp=EsampConfig(beta=2.0), seed=5, max_tokens=24, n=4)
    ids = lambda toks: [[t.token_id for t in toks[s]] for s in sorted(toks)]  # noqa: E731
    assert ids(off) != ids(on)


def test_rows_keep_their_state_when_the_batch_shrinks(reference_engine, monkeypatch):
    """Every step's logits for every live sample equal a full forward of that sample's text (one
    forward per sample: a causal model's logits at each position are those of the text up to it)."""
    engine = reference_engine
    seen = []
    original = engine._forward

    def spy(group):
        alive_before = list(group.alive) or list(range(group.sampling.n))
        logits, x, y = original(group)
        seen.append((alive_before if group.steps else None, logits.clone()))
        return logits, x, y

    monkeypatch.setattr(engine, "_forward", spy)
    events, tokens = _collect(
        engine, esamp=EsampConfig(enabled=False), seed=3, max_tokens=20, temperature=1.0, top_p=1.0, min_p=0.0
    )
    lengths = {d.sample: d.tokens for d in events if isinstance(d, DoneEvent)}
    assert len(set(lengths.values())) > 1, "the run should finish samples at different steps"
    group_prompt = engine.encode(PROMPT)
    ids = {s: [t.token_id for t in seq] for s, seq in tokens.items()}
    with torch.inference_mode():
        full = {s: engine.model(input_ids=torch.tensor([group_prompt + ids[s]])).logits[0] for s in ids}
    checked = 0
    for step, (alive, logits) in enumerate(seen[1:], start=1):
        for row, sample in enumerate(alive):
            ref = full[sample][len(group_prompt) + step - 1]  # after the prompt and the first step tokens
            torch.testing.assert_close(logits[row], ref, atol=2e-3, rtol=1e-3)
            checked += 1
    assert checked > 20


def test_sequential_runs_share_no_state(reference_engine):
    _, first = _collect(reference_engine, "Write one word about the sea.", seed=2)
    _collect(reference_engine, "Count to three.", seed=9)
    _, again = _collect(reference_engine, "Write one word about the sea.", seed=2)
    ids = lambda toks: [[t.token_id for t in toks[s]] for s in sorted(toks)]  # noqa: E731
    assert ids(first) == ids(again)
    assert reference_engine.bank.groups == {}


def test_two_groups_at_once_match_each_alone(reference_engine):
    engine = reference_engine
    sampling = SamplingConfig(n=2, max_tokens=10, seed=4)
    _, off_alone = _collect(engine, esamp=EsampConfig(enabled=False), n=2, max_tokens=10, seed=4)
    _, on_alone = _collect(engine, esamp=EsampConfig(), n=2, max_tokens=10, seed=4)
    g_off = engine.start(PROMPT, sampling, Steering(enabled=False))
    g_on = engine.start(PROMPT, sampling, Steering())
    together: dict[str, dict[int, list[int]]] = {g_off: {}, g_on: {}}
    while engine.has_unfinished():
        for ev in engine.step():
            if isinstance(ev, TokenEvent):
                together[ev.group].setdefault(ev.sample, []).append(ev.token_id)
    ids = lambda toks: {s: [t.token_id for t in seq] for s, seq in toks.items()}  # noqa: E731
    assert together[g_off] == ids(off_alone)
    assert together[g_on] == ids(on_alone)


def test_abort_frees_the_slot_and_ends_every_sample(reference_engine):
    engine = reference_engine
    g = engine.start(PROMPT, SamplingConfig(n=3, max_tokens=50))
    engine.step()
    engine.step()
    events = engine.abort(g)
    assert sorted(e.sample for e in events if isinstance(e, DoneEvent)) == [0, 1, 2]
    assert all(e.finish_reason == "abort" for e in events if isinstance(e, DoneEvent))
    assert not engine.has_unfinished() and engine.bank.groups == {}


def test_empty_and_too_long_prompts_are_clear_errors(reference_engine):
    with pytest.raises(PromptError, match="empty"):
        reference_engine.start("   ", SamplingConfig())
    with pytest.raises(PromptError, match="longer than the model's context") as info:
        reference_engine.start("word " * (reference_engine.context + 10), SamplingConfig())
    assert "shorten" in info.value.hint
    assert reference_engine.bank.groups == {}


def test_a_full_bank_refuses_a_new_group_and_loses_nothing(reference_engine):
    from esamp.errors import BankFullError

    engine = reference_engine
    sampling = SamplingConfig(n=1, max_tokens=2)
    groups = [engine.start(PROMPT, sampling) for _ in range(engine.bank.capacity)]
    try:
        with pytest.raises(BankFullError) as info:
            engine.start(PROMPT, sampling)
        assert info.value.hint and len(engine.groups) == engine.bank.capacity
        # plain sampling needs no slot and still runs
        plain = engine.start(PROMPT, sampling, Steering(enabled=False))
        assert plain in engine.groups
    finally:
        for g in list(engine.groups):
            engine.abort(g)
    assert engine.bank.free_slots == engine.bank.capacity and set(groups).isdisjoint(engine.groups)
