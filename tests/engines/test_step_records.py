"""Step records: kept as columns, handed out as rows or columns, taken per group, expired unread."""

from __future__ import annotations

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
