"""The pairing of tokens with step records (``esamp.engines.record_streams``), without an engine:
tokens and records are handed in step by step, as the vLLM engine and the endpoint client do."""

from __future__ import annotations

import math
import random

import pytest

from esamp.core.config import EsampConfig, SamplingConfig, Steering
from esamp.engines.base import StepStats
from esamp.engines.record_streams import RecordedEngine, RecordedGroup
from esamp.engines.vllm.step_records import COLUMNS


class Scripted(RecordedEngine):
    """A ``RecordedEngine`` whose tokens and records are given, one engine step per ``feed``."""

    name = "scripted"

    def __init__(self) -> None:
        super().__init__(EsampConfig())
        self.context, self.hidden, self.num_layers = 1000, 8, 2
        self.model_name = self.device_name = "scripted"
        self._loaded()

    def _admit(self, group) -> RecordedGroup:
        g = RecordedGroup(**vars(group))
        g.arrived = [[] for _ in range(g.sampling.n)]
        g.fed = [0] * g.sampling.n
        return g

    def _release(self, g) -> None:
        pass

    def feed(self, tokens=(), records=(), finals=(), all_back=True) -> list:
        """``tokens``: (group, sample, token ids); ``records``: step records; ``finals``: (group,
        sample, reason)."""
        for key, sample, ids in tokens:
            self.groups[key].arrived[sample].extend(ids)
        for key, sample, reason in finals:
            self.groups[key].final[sample] = reason
        stats = StepStats()
        for rec in records:
            self._file(rec, stats)
        return self._advance_groups(lambda g: self._advance(g, all_back), stats)


def record(step: int, rows: list[tuple], loss: dict | None = None, as_rows: bool = False) -> dict:
    """A step record as ``esamp_drain`` sends it: rows (group, sample, gen idx, error, candidates)
    as columns, or as rows (the endpoint's form)."""
    rec = {"step": step, "time": float(step), "loss": loss or {}}
    if as_rows:
        rec["rows"] = list(rows)
    else:
        rec["columns"] = dict(zip(COLUMNS, (list(c) for c in zip(*rows)))) if rows else {c: [] for c in COLUMNS}
    return rec


def run(script: list[dict], groups=(("a", 2, True),)) -> list[dict]:
    """Every event of a script of steps (``Scripted.feed``'s arguments), times left out."""
    engine = Scripted()
    for key, n, steered in groups:
        engine.start([1, 2, 3], SamplingConfig(n=n, max_tokens=64), Steering(enabled=steered), group=key)
    events = []
    for step in script:
        events += engine.feed(**step)
    assert not engine.has_unfinished()
    return [e.model_dump(exclude={"time", "tokens_per_s"}) for e in events]


def released(events: list[dict]) -> list[dict]:
    """The tokens and dones (step events count rows as their records come)."""
    return [e for e in events if e["type"] != "step"]


def decode(n: int, length: int, errors, key: str = "a", first_step: int = 10) -> list[dict]:
    """n samples decoding ``length`` tokens in lockstep; each step's record with the step's output."""
    steps = []
    for k in range(length):
        rows = [(key, s, k, errors(s, k), 2) for s in range(n)]
        tokens = [(key, s, [100 + 10 * k + s]) for s in range(n)]
        steps.append(dict(tokens=tokens, records=[record(first_step + k, rows)]))
    steps[-1]["finals"] = [(key, s, "length") for s in range(n)]
    return steps


def err(s: int, k: int) -> float:
    return 0.5 + 0.1 * s + 0.07 * k


def test_tokens_carry_the_error_of_the_step_where_they_were_the_input():
    events = run(decode(2, 4, err))
    tokens = [e for e in events if e["type"] == "token"]
    assert [(e["sample"], e["index"]) for e in tokens] == [(s % 2, s // 2) for s in range(8)]
    assert all(e["novelty"] is not None for e in tokens[:6]) and tokens[0]["novelty"] == 0.5
    assert tokens[-1]["novelty"] is None and tokens[-2]["novelty"] is None  # never an input
    assert [e["type"] for e in events].count("done") == 2 and events[-1]["type"] == "step"


def test_records_ahead_of_their_tokens_wait_for_them():
    """Every record at once, the tokens one step at a time: the same events, released as tokens come."""
    steps = decode(2, 4, err)
    early = [dict(step, records=[]) for step in steps]
    early[0]["records"] = [rec for step in steps for rec in step["records"]]
    assert released(run(early)) == released(run(steps))


def test_tokens_ahead_of_their_records_wait_for_them():
    """Every token (and the finish) before any record: nothing goes out while steps are still to
    report (``all_back`` false), then the same events as when each record came with its tokens."""
    steps = decode(2, 4, err)
    late = [dict(step, records=[], all_back=False) for step in steps]
    late.append(dict(records=[rec for step in steps for rec in step["records"]]))
    assert released(run(late)) == released(run(steps))


@pytest.mark.parametrize("as_rows", [False, True])
def test_rows_in_any_order_and_groups_interleaved_give_the_same_events(as_rows):
    """vLLM's batch may hold a group's rows apart and out of order; the endpoint sends rows."""
    groups = (("a", 3, True), ("b", 2, True))
    rng = random.Random(0)
    ordered, shuffled = [], []
    for k in range(5):
        rows = [(key, s, k, err(s, k) + (0.3 if key == "b" else 0.0), 1 + s) for key, n, _ in groups for s in range(n)]
        tokens = [(key, s, [200 + k]) for key, n, _ in groups for s in range(n)]
        mixed = rows[:]
        rng.shuffle(mixed)
        ordered.append(dict(tokens=tokens, records=[record(k, rows, loss={"a": 1.0, "b": 2.0})]))
        shuffled.append(dict(tokens=tokens, records=[record(k, mixed, loss={"a": 1.0, "b": 2.0}, as_rows=as_rows)]))
    for steps in (ordered, shuffled):
        steps[-1]["finals"] = [(key, s, "length") for key, n, _ in groups for s in range(n)]
    got = run(shuffled, groups)
    assert got == run(ordered, groups)
    steps = [e for e in got if e["type"] == "step"]
    assert sum(e["port_hits"] for e in steps) == 5 * 5 and all(e["losses"] == {"a": [1.0], "b": [2.0]} for e in steps)


def test_a_later_row_of_the_same_sample_and_index_supersedes_the_earlier():
    """A row filed again (a later prefill chunk, a recomputed request) counts with its own error,
    while the earlier step's record still waits for its tokens."""

    def script(first_error: float | None) -> list[dict]:
        steps = decode(2, 4, err)
        if first_error is not None:
            # sample 0's gen idx 2 was filed at step 11 already (its tokens not back), then again
            early = record(11, [("a", 0, 2, first_error, 2)])
            steps[1]["records"] = [early, *steps[1]["records"]]
        return steps

    plain = released(run(script(None)))
    assert released(run(script(9.0))) == plain
    # the test sees it: with the earlier row's error counting, the events differ
    assert released(run(decode(2, 4, lambda s, k: 9.0 if (s, k) == (0, 2) else err(s, k)))) != plain


def test_superseded_prefill_chunks_do_not_hold_the_group_back():
    """Rows of a prefill's first chunk (gen idx 0, no token) are superseded by the last chunk's."""
    steps = decode(2, 3, err, first_step=20)
    chunked = [dict(records=[record(19, [("a", 0, 0, 0.1, 1), ("a", 1, 0, 0.2, 1)])]), *steps]
    assert released(run(chunked)) == released(run(steps))


def test_a_sample_without_records_ends_without_novelty_once_every_step_reported():
    """A sample the processor could not steer: its tokens go out once ``all_back`` says no record
    will come."""
    steps = decode(2, 3, err)
    for step in steps:
        for rec in step["records"]:
            cols = rec["columns"]
            keep = [i for i, s in enumerate(cols["samples"]) if s == 0]
            rec["columns"] = {c: [v[i] for i in keep] for c, v in cols.items()}
    held = [dict(step, all_back=False) for step in steps] + [dict(all_back=True)]
    events = run(held)
    one = [e for e in events if e["type"] == "token" and e["sample"] == 1]
    assert [e["index"] for e in one] == [0, 1, 2] and all(e["novelty"] is None for e in one)
    zero = [e for e in events if e["type"] == "token" and e["sample"] == 0]
    assert [e["index"] for e in zero] == [0, 1, 2] and zero[0]["novelty"] is not None


def test_non_finite_errors_give_no_novelty_and_unsteered_groups_pass_through():
    steps = decode(1, 3, lambda s, k: math.nan if k == 1 else 1.0)
    tokens = [e for e in run(steps, (("a", 1, True),)) if e["type"] == "token"]
    assert [e["novelty"] for e in tokens] == [None, 0.5, None]
    plain = [dict(tokens=step["tokens"], finals=step.get("finals", [])) for step in steps]
    tokens = [e for e in run(plain, (("a", 1, False),)) if e["type"] == "token"]
    assert [(e["index"], e["novelty"]) for e in tokens] == [(0, None), (1, None), (2, None)]
