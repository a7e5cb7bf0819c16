import pickle

import pytest
from pydantic import ValidationError

from esamp.events import DoneEvent, ErrorEvent, StepEvent, TokenEvent, event_from_json


def test_every_event_round_trips_through_json_and_pickle():
    events = [
        TokenEvent(group="g", sample=1, index=0, token_id=5, text="hi", novelty=0.25),
        TokenEvent(group="g", sample=1, index=1, token_id=6, text="!", novelty=None),
        StepEvent(step=0, rows=4, tokens_per_s=12.5, loss=0.3, port_hits=4, candidates=3.5, esamp=True),
        StepEvent(step=1, rows=4, tokens_per_s=12.5, loss=0.3, losses={"a": [0.2, 0.3], "b": [0.4]}, esamp=True),
        DoneEvent(group="g", sample=1, finish_reason="stop", tokens=2),
        ErrorEvent(message="boom", hint="retry", fatal=True),
    ]
    for ev in events:
        assert event_from_json(ev.model_dump_json()) == ev
        assert pickle.loads(pickle.dumps(ev)) == ev
        assert ev.model_dump()["type"] in ("token", "step", "done", "error")


def test_novelty_outside_unit_interval_is_rejected():
    with pytest.raises(ValidationError):
        TokenEvent(group="g", sample=0, index=0, token_id=1, text="x", novelty=1.5)


def test_unknown_type_is_rejected():
    with pytest.raises(ValidationError):
        event_from_json('{"type": "tokens", "group": "g"}')


def test_a_step_keeps_each_groups_losses_and_their_mean():
    """``losses`` says whose loss each value is (the eval attributes it to the group's step);
    ``loss``, what the dashboard charts, is the mean of every value."""
    from esamp.engines.base import RateMeter, StepStats

    stats = StepStats(rows=3, port_hits=3)
    for group, loss in [("a", 0.2), ("b", 0.4), ("a", 0.3)]:  # two drained engine steps
        stats.add_loss(group, loss)
    event = stats.event(0, RateMeter())
    assert event.losses == {"a": [0.2, 0.3], "b": [0.4]} and event.loss == pytest.approx(0.3)
    assert StepStats(rows=1).event(1, RateMeter()).losses == {} and StepStats(rows=1).event(1, RateMeter()).loss is None
