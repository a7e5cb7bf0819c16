"""Step records: kept as columns, handed out as rows or columns, taken per group, expired unread."""

from __future__ import annotations

import pytest
import torch

from esamp.engines.vllm.step_records import RecordStore


def _push(store: RecordStore, step: int, groups: list[str], keep=None) -> None:
    n = len(groups)
    packed = RecordStore.pack(torch.arange(n, dtype=torch.float32) / 4, torch.full((n,), 3), torch.tensor([0.5, 0.0]))
    store.push(step, groups, list(range(n)), [step] * n, packed, [groups[0], None], keep=keep)


def test_rows_and_columns_carry_the_same_record():
    store = RecordStore(torch.device("cpu"))
    _push(store, 1, ["a", "b", "a"])
    _push(store, 2, ["b"])
    mine, pending = store.take({"a"}, columns=True)
    assert pending == 0 and len(mine) == 1
    cols = mine[0]["columns"]
    assert cols["groups"] == ["a", "a"] and cols["samples"] == [0, 2] and cols["candidates"] == [3, 3]
    assert mine[0]["loss"] == {"a": 0.5}  # the unit that did not train (None) reports nothing
    rest, _ = store.take()
    assert [r["rows"] for r in rest] == [[("b", 1, 1, 0.25, 3)], [("b", 0, 2, 0.0, 3)]]
    assert store.take() == ([], 0)


def test_records_of_ended_groups_expire_without_a_reader():
    store = RecordStore(torch.device("cpu"), retain_seconds=5)
    _push(store, 1, ["gone", "live"])
    store.collect()
    later = store._ready[0]["time"] + 6
    store.expire({"live"}, now=later)
    assert store.dropped == 1
    left, _ = store.take()
    assert [r["rows"] for r in left] == [[("live", 1, 1, 0.25, 3)]]


def test_only_the_groups_that_asked_are_kept():
    store = RecordStore(torch.device("cpu"))
    _push(store, 1, ["a", "b"], keep={"b"})
    _push(store, 2, ["a"], keep=set())
    out, _ = store.take()
    assert [r["rows"] for r in out] == [[("b", 1, 1, 0.25, 3)]] and store.loss == 0.5


def test_unread_records_are_bounded(monkeypatch):
    from esamp.engines.vllm import step_records

    monkeypatch.setattr(step_records, "MAX_READY", 3)
    store = RecordStore(torch.device("cpu"))
    for step in range(5):
        _push(store, step, ["a", "b"])
    out, _ = store.take()
    assert [r["step"] for r in out] == [2, 3, 4] and store.dropped == 4


def test_readers_get_plain_values_and_the_store_keeps_its_rows_unconverted():
    """A ready record keeps the device's values as one array (nothing converted row by row in the
    engine's process, where a reader's thread competes with the steps for the interpreter);
    readers get Python floats and ints, in rows and in columns alike."""
    import numpy as np

    store = RecordStore(torch.device("cpu"))
    groups = ["a", "b"] * 64
    _push(store, 1, groups)
    store.collect()
    kept = store._ready[0]["cols"]
    assert isinstance(kept[3], np.ndarray) and isinstance(kept[4], np.ndarray)
    (rec,), _ = store.take(columns=True)
    cols = rec["columns"]
    assert cols["errors"] == [i / 4 for i in range(128)] and cols["candidates"] == [3] * 128
    assert all(type(v) is float for v in cols["errors"]) and all(type(c) is int for c in cols["candidates"])
    _push(store, 2, groups, keep={"b"})
    (rec,), _ = store.take({"b"})
    assert rec["rows"] == [("b", i, 2, i / 4, 3) for i in range(1, 128, 2)]
    assert all(type(r[3]) is float and type(r[4]) is int for r in rec["rows"])


class _Event:
    """Stands in for a CUDA event: done once the test says its copies finished."""

    def __init__(self) -> None:
        self.done = False
        self.stream = None

    def query(self) -> bool:
        return self.done


def test_one_event_marks_a_batch_of_copies_and_a_reader_marks_the_rest(monkeypatch):
    """On a GPU a record's copy is marked by an event shared with the copies around it (one per
    ``MARK_EVERY``): nothing is handed out before its event is done, the records come out in step
    order, a reader marks the copies no event covers yet, and a new copy stream closes the batch."""
    from esamp.engines.vllm import step_records as sr

    made: list[_Event] = []
    stream = ["s0"]

    def event():
        made.append(_Event())
        return made[-1]

    def record(ev, on):
        ev.stream = on

    monkeypatch.setattr(sr.torch.cuda, "Event", event)
    monkeypatch.setattr(sr.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(sr.streams, "record", record)
    monkeypatch.setattr(sr.streams, "current", lambda device: stream[0])
    monkeypatch.setattr(sr.torch, "empty", lambda n, dtype, pin_memory: torch.zeros(n, dtype=dtype))
    store = RecordStore(torch.device("cuda", 0))
    for step in range(sr.MARK_EVERY + 3):
        _push(store, step, ["a"])
    assert len(made) == 1 and made[0].stream == "s0"  # the first MARK_EVERY copies, one event
    assert store.take() == ([], sr.MARK_EVERY + 3)  # nothing finished; the reader marked the other 3
    assert len(made) == 2
    made[1].done = True  # the later event done before the earlier: still nothing out of order
    assert store.take() == ([], sr.MARK_EVERY + 3)
    made[0].done = True
    steps, pending = store.take()
    assert [r["step"] for r in steps] == list(range(sr.MARK_EVERY + 3)) and pending == 0
    assert steps[0]["rows"] == [("a", 0, 0, 0.0, 3)]
    _push(store, 100, ["a"])
    stream[0] = "s1"  # the engine's copies moved to another stream: the batch on s0 is closed first
    _push(store, 101, ["a"])
    assert len(made) == 3 and made[2].stream == "s0"
    store.collect()  # marks the copy on s1
    assert len(made) == 4 and made[3].stream == "s1"
    made[2].done = made[3].done = True
    assert [r["step"] for r in store.take()[0]] == [100, 101]


@pytest.mark.cuda
def test_records_copied_from_the_gpu_come_back_whole_in_order():
    store = RecordStore(torch.device("cuda"))
    for step in range(21):
        n = 1 + step % 5
        errors, counts = torch.full((n,), float(step), device="cuda"), torch.arange(n, device="cuda")
        packed = RecordStore.pack(errors, counts, torch.tensor([step / 10], device="cuda"))
        store.push(step, ["g"] * n, list(range(n)), [step] * n, packed, ["g"])
    torch.cuda.synchronize()
    steps, pending = store.take()
    assert pending == 0 and [r["step"] for r in steps] == list(range(21))
    for r in steps:
        n = 1 + r["step"] % 5
        assert r["rows"] == [("g", i, r["step"], float(r["step"]), i) for i in range(n)]
        assert r["loss"] == {"g": pytest.approx(r["step"] / 10)}
