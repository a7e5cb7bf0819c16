"""The reference engine with the shared Distiller (``distiller="shared"``) on the embedded model:
one Distiller step per engine step over every group's rows, kept across groups, slots counted."""

from __future__ import annotations

import pytest
import torch

from esamp.core.config import EsampConfig, SamplingConfig, Steering
from esamp.core.distiller import SHARED_SLOT
from esamp.errors import BankFullError
from esamp.events import StepEvent, TokenEvent

pytestmark = pytest.mark.slow
PROMPT_A = "Name a colour."
PROMPT_B = "Count to three."


def _shared_engine():
    from esamp.engines.reference import ReferenceEngine

    return ReferenceEngine(esamp=EsampConfig(slots=2, distiller="shared"))


@pytest.fixture(scope="module")
def shared_engine():
    engine = _shared_engine()
    yield engine
    engine.close()


def _run(engine, starts: list[tuple[str, SamplingConfig, Steering | None]]):
    """Start the groups together and run them to their end: (keys, token ids per group and sample,
    step events)."""
    keys = [engine.start(prompt, sampling, steering) for prompt, sampling, steering in starts]
    tokens: dict[str, dict[int, list[int]]] = {k: {} for k in keys}
    steps = []
    while engine.has_unfinished():
        for ev in engine.step():
            if isinstance(ev, TokenEvent):
                tokens[ev.group].setdefault(ev.sample, []).append(ev.token_id)
            elif isinstance(ev, StepEvent):
                steps.append(ev)
    return keys, tokens, steps


def test_beta_zero_is_plain_sampling_with_groups_sharing_the_distiller(shared_engine):
    sampling = [SamplingConfig(n=3, max_tokens=16, seed=11), SamplingConfig(n=2, max_tokens=12, seed=4)]
    zero_keys, zero, steps = _run(
        shared_engine, [(PROMPT_A, sampling[0], Steering(beta=0.0)), (PROMPT_B, sampling[1], Steering(beta=0.0))]
    )
    off_keys, off, _ = _run(
        shared_engine,
        [(PROMPT_A, sampling[0], Steering(enabled=False)), (PROMPT_B, sampling[1], Steering(enabled=False))],
    )
    assert [zero[k] for k in zero_keys] == [off[k] for k in off_keys]
    assert all(s.loss is not None for s in steps)  # the shared Distiller trained all along


def test_one_distiller_step_per_engine_step_covers_every_groups_rows(shared_engine, monkeypatch):
    """Two groups at once: each engine step runs the shared Distiller once, on one unit holding
    every running sample of both groups (a group's first step: its prompt row once per sample), and
    reports that step's one loss."""
    calls = []
    distill = shared_engine.steerer.distill

    def spy(plan, x, y, *args, **kwargs):
        out = distill(plan, x, y, *args, **kwargs)
        calls.append((plan.layout.shape, plan.layout.slots, plan.trains, out[2]))
        return out

    monkeypatch.setattr(shared_engine.steerer, "distill", spy)
    keys, _, steps = _run(
        shared_engine,
        [
            (PROMPT_A, SamplingConfig(n=2, max_tokens=8, seed=1), Steering()),
            (PROMPT_B, SamplingConfig(n=3, max_tokens=8, seed=2), Steering(train_rows="all")),
        ],
    )
    assert len(calls) == len(steps)  # one Distiller step per engine step
    assert calls[0][0] == (1, 5) and calls[0][1] == (SHARED_SLOT,)
    # train_rows: group A ("group") trains its first row, group B ("all") all three
    assert calls[0][2] == (True, False, True, True, True)
    for (shape, _, trains, loss), step in zip(calls, steps):
        assert shape[0] == 1 and shape[1] == step.port_hits == len(trains)
        assert loss.shape == (1,) and step.loss == pytest.approx(float(loss))


def test_a_group_starts_from_the_weights_the_last_one_left(reference_engine):
    """The shared Distiller is never reset while the engine runs: a group's end leaves its weights
    to the next group, so the same prompt run again starts at a lower loss. A bank resets."""
    engine = _shared_engine()  # a fresh Distiller: the first run starts from the initial weights
    try:
        bank = engine.bank
        sampling = SamplingConfig(n=3, max_tokens=16, seed=1)
        _, _, first = _run(engine, [(PROMPT_A, sampling, None)])
        left = bank.store.flat.clone()
        steps = float(bank.store.steps[SHARED_SLOT])
        assert bank.groups == {} and bank.free_slots == bank.capacity
        assert not torch.equal(left, bank.store.initial)
        _run(engine, [(PROMPT_B, sampling, None)])
        assert float(bank.store.steps[SHARED_SLOT]) > steps  # it went on from there
        assert not torch.equal(bank.store.flat, left)
        _, _, again = _run(engine, [(PROMPT_A, sampling, None)])
        assert again[0].loss < 0.9 * first[0].loss
    finally:
        engine.close()

    _run(reference_engine, [(PROMPT_A, sampling, None)])  # a bank: its slot starts fresh again
    assert torch.equal(reference_engine.bank.store.flat, reference_engine.bank.store.initial)


def test_slots_count_groups_and_an_abort_keeps_what_the_distiller_learnt(shared_engine):
    bank = shared_engine.bank
    sampling = SamplingConfig(n=1, max_tokens=30)
    groups = [shared_engine.start(PROMPT_A, sampling) for _ in range(bank.capacity)]
    try:
        assert bank.groups == {g: SHARED_SLOT for g in groups} and bank.free_slots == 0
        with pytest.raises(BankFullError) as info:
            shared_engine.start(PROMPT_A, sampling)
        assert "shared Distiller" in str(info.value) and info.value.hint
        plain = shared_engine.start(PROMPT_A, sampling, Steering(enabled=False))  # needs no slot
        shared_engine.step()
        shared_engine.step()
        learnt = bank.store.flat.clone()
        shared_engine.abort(groups[0])
        assert torch.equal(bank.store.flat, learnt) and bank.free_slots == 1
        assert plain in shared_engine.groups
    finally:
        for g in list(shared_engine.groups):
            shared_engine.abort(g)
    assert bank.free_slots == bank.capacity and bank.groups == {}


def test_a_group_key_used_again_gets_a_plan_of_its_own(shared_engine, monkeypatch):
    """Keys are free again once their group ends: the shared Distiller's plan follows the new
    group's settings, not the old one's."""
    trains = []
    distill = shared_engine.steerer.distill

    def spy(plan, x, y, *args, **kwargs):
        trains.append(plan.trains)
        return distill(plan, x, y, *args, **kwargs)

    monkeypatch.setattr(shared_engine.steerer, "distill", spy)
    sampling = SamplingConfig(n=2, max_tokens=3, seed=1)
    for rows in ("all", "group"):
        shared_engine.start(PROMPT_A, sampling, Steering(train_rows=rows), group="again")
        while shared_engine.has_unfinished():
            shared_engine.step()
        assert trains[-1] == ((True, True) if rows == "all" else (True, False))
