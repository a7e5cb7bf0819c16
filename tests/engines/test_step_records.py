"""Step records: kept as columns, handed out as rows or columns, taken per group, expired unread."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from esamp.engines.vllm.step_records import RecordStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from _interpreter import in_tritons_interpreter  # noqa: E402 (tests/core's, where the interpreter runs start)


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


def _as_on_a_gpu(monkeypatch, stream: list[str]) -> tuple[RecordStore, list[_Event]]:
    """A store whose ring lives on the CPU but which copies and marks as on a GPU: its copies to
    the host are non-blocking ones marked by (stand-in) events on the stream the values were
    written on (``stream[0]`` at each push), a reader switching to that stream to copy."""
    from esamp.engines.vllm import step_records as sr

    made: list[_Event] = []
    current = {"now": None}

    def event():
        made.append(_Event())
        return made[-1]

    def record(ev, on):
        assert current["now"] in (None, on), "a copy's event is recorded on the stream of the copy"
        ev.stream = on

    monkeypatch.setattr(sr.torch.cuda, "Event", event)
    monkeypatch.setattr(sr.streams, "index_of", lambda device: 0)
    monkeypatch.setattr(sr.streams, "record", record)
    monkeypatch.setattr(sr.streams, "current", lambda device: current["now"] or stream[0])
    monkeypatch.setattr(sr.streams, "switch", lambda s: current.update(now=s))
    real_empty = torch.empty
    monkeypatch.setattr(sr.torch, "empty", lambda *shape, dtype, pin_memory: real_empty(*shape, dtype=dtype))
    store = RecordStore(torch.device("cpu"))
    store._cuda = True
    return store, made


def test_one_copy_and_one_event_take_a_batch_of_steps_and_a_reader_copies_the_rest(monkeypatch):
    """On a GPU the staged values of ``MARK_EVERY`` steps leave the device ring in one copy marked
    by one event: nothing is handed out before its event is done, the records come out in step
    order with their own values, a reader copies the steps no copy took yet, and a new stream
    closes the batch (its copy goes on the stream the values were written on)."""
    from esamp.engines.vllm import step_records as sr

    stream = ["s0"]
    store, made = _as_on_a_gpu(monkeypatch, stream)

    def push(step):
        packed = RecordStore.pack(torch.tensor([step / 4]), torch.tensor([3]), torch.tensor([0.5, 0.0]))
        store.push(step, ["a"], [0], [step], packed, ["a", None])

    for step in range(sr.MARK_EVERY + 3):
        push(step)
    assert len(made) == 1 and made[0].stream == "s0"  # the first MARK_EVERY steps, one copy, one event
    assert store.take() == ([], sr.MARK_EVERY + 3)  # nothing finished; the reader copied the other 3
    assert len(made) == 2
    made[1].done = True  # the later event done before the earlier: still nothing out of order
    assert store.take() == ([], sr.MARK_EVERY + 3)
    made[0].done = True
    steps, pending = store.take()
    assert [r["step"] for r in steps] == list(range(sr.MARK_EVERY + 3)) and pending == 0
    assert [r["rows"] for r in steps] == [[("a", 0, s, s / 4, 3)] for s in range(sr.MARK_EVERY + 3)]
    push(100)
    stream[0] = "s1"  # the engine's steps moved to another stream: the batch on s0 is copied first
    push(101)
    assert len(made) == 3 and made[2].stream == "s0"
    store.collect()  # copies the step written on s1, from s1
    assert len(made) == 4 and made[3].stream == "s1"
    made[2].done = made[3].done = True
    assert [r["rows"] for r in store.take()[0]] == [[("a", 0, 100, 25.0, 3)], [("a", 0, 101, 25.25, 3)]]


def test_a_reader_that_waits_gets_the_copies_in_flight_in_one_take(monkeypatch):
    """``take(wait=...)`` starts the copy of the staged steps and waits for the last copy in flight,
    up to ``wait`` seconds, without holding the store's lock (the engine's steps push meanwhile):
    a run's last records come back in one fetch. A copy not done in time leaves its records
    pending, as a take that does not wait; a store with nothing in flight does not wait."""
    from esamp.engines.vllm import step_records as sr

    store, made = _as_on_a_gpu(monkeypatch, ["s0"])
    clock = [0.0]
    polls = []

    def sleep(seconds):
        assert store._lock.acquire(blocking=False), "a waiting reader holds no lock"
        store._lock.release()
        polls.append(seconds)
        clock[0] += seconds
        if len(polls) == 3:
            made[-1].done = True  # the copy finishes while the reader waits

    monkeypatch.setattr(sr.time, "sleep", sleep)
    monkeypatch.setattr(sr.time, "monotonic", lambda: clock[0])

    def push(step):
        packed = RecordStore.pack(torch.tensor([step / 4]), torch.tensor([3]), None)
        store.push(step, ["a"], [0], [step], packed, [])

    for step in range(3):
        push(step)
    assert made == []  # staged only: their copy starts with the reader
    steps, pending = store.take(wait=1.0)
    assert [r["step"] for r in steps] == [0, 1, 2] and pending == 0
    assert len(made) == 1 and polls == [sr.WAIT_POLL_SECONDS] * 3
    push(3)
    steps, pending = store.take(wait=10 * sr.WAIT_POLL_SECONDS)  # its copy never finishes in time
    assert steps == [] and pending == 1 and len(polls) == 3 + 10
    made[-1].done = True
    assert store.settle(1.0) and len(polls) == 13  # done already: no wait
    assert [r["step"] for r in store.take()[0]] == [3]
    assert store.settle(1.0) and len(polls) == 13  # nothing in flight


def test_the_ring_wraps_and_its_host_buffers_are_reused(monkeypatch):
    """Past the ring's last row the next step writes its first again, and a copy that spans the end
    comes back in order; a host buffer goes back for reuse once every record of it is read."""
    from esamp.engines.vllm import step_records as sr

    store, made = _as_on_a_gpu(monkeypatch, ["s0"])
    seen = []

    def read():
        store.collect()  # copies what is staged
        for ev in made:
            ev.done = True
        seen.extend(store.take()[0])

    for step in range(3 * sr.RING_ROWS + 5):
        n = 1 + step % 3  # records of several lengths share the ring's rows
        packed = RecordStore.pack(torch.full((n,), float(step)), torch.arange(n), torch.tensor([step / 8]))
        store.push(step, ["g"] * n, list(range(n)), [step] * n, packed, ["g"])
        if step % 5 == 4:  # a reader now and then: partial copies move where the next copy starts
            read()
    read()
    assert [r["step"] for r in seen] == list(range(3 * sr.RING_ROWS + 5))
    for r in seen:
        n, s = 1 + r["step"] % 3, r["step"]
        assert r["rows"] == [("g", i, s, float(s), i) for i in range(n)] and r["loss"] == {"g": s / 8}
    assert len(store._buffers) >= 1 and len(made) > 2 * len(store._buffers)  # buffers came back and were reused


def test_a_reader_thread_copies_into_buffers_the_engine_thread_made_under_inference_mode():
    """The engine steps under vLLM's inference mode, so a host buffer made there is an inference
    tensor; a reader in another thread (a server's records channel) copies the staged rows into
    such a buffer outside inference mode, which torch refuses unless the copy runs under it (every
    bench on Model Runner V2 stopped so on the GPU)."""
    import threading

    from esamp.engines.vllm import step_records as sr

    store = RecordStore(torch.device("cpu"))

    def engine_steps(first: int) -> None:
        with torch.inference_mode():
            for step in range(first, first + sr.MARK_EVERY):
                _push(store, step, ["a"])
            store.collect()  # the records are read: their buffer goes back for reuse

    worker = threading.Thread(target=engine_steps, args=(0,))
    worker.start()
    worker.join()
    (made,) = store._buffers
    assert made.is_inference()
    with torch.inference_mode():
        _push(store, 100, ["a"])  # staged on the engine's thread, not yet copied
    taken, pending = store.take()  # here: no inference mode; the copy reuses that buffer
    assert pending == 0 and [r["step"] for r in taken] == [*range(sr.MARK_EVERY), 100]
    assert taken[-1]["rows"] == [("a", 0, 100, 0.0, 3)]


def test_a_restart_forgets_values_staged_without_a_record():
    """An engine's captures run each step once before its first request: what they staged is no
    record's, and a restart makes the next step's values the first record's again."""
    store = RecordStore(torch.device("cpu"))
    for _ in range(3):
        store.stage(RecordStore.pack(torch.tensor([9.0]), torch.tensor([9]), None))
    store.restart()
    _push(store, 1, ["a"])
    (rec,), _ = store.take()
    assert rec["rows"] == [("a", 0, 1, 0.0, 3)]


def test_a_step_longer_than_the_ring_row_is_an_error():
    store = RecordStore(torch.device("cpu"), width=4)
    with pytest.raises(ValueError, match="holds 4"):
        store.stage(torch.zeros(5))


def test_each_loss_goes_to_the_groups_that_own_it():
    """A packed loss is one group's, several groups' (the shared Distiller's) or nobody's; the
    owners' list a plan hands every step is read once; a step that packed fewer losses than it
    names owners gives the rest none."""
    store = RecordStore(torch.device("cpu"))
    owners = [("a", "b"), None, "c", "d"]
    for step, losses in enumerate(([0.5, 9.0, 0.25, 0.125], [0.75, 9.0, 0.5, 0.375], None, [1.0, 9.0])):
        if losses is None:  # a step that trained nothing: no losses, no owners
            store.push(step, ["a"], [0], [step], RecordStore.pack(torch.tensor([0.0]), torch.tensor([1]), None), [])
            continue
        packed = RecordStore.pack(torch.tensor([0.0]), torch.tensor([1]), torch.tensor(losses))
        store.push(step, ["a"], [0], [step], packed, owners)
    got = [rec["loss"] for rec in store.take()[0]]
    assert store._owners_seen[0] is owners  # (the step without owners left the plan's layout)
    assert got == [
        {"a": 0.5, "b": 0.5, "c": 0.25, "d": 0.125},
        {"a": 0.75, "b": 0.75, "c": 0.5, "d": 0.375},
        {},
        {"a": 1.0, "b": 1.0},
    ]
    assert store.loss == pytest.approx(0.9 * (0.9 * 0.34375 + 0.1 * 0.59375) + 0.1 * 1.0)


def check_stage_parts(device: str) -> None:
    """``stage_parts`` (one Triton launch on a GPU or in Triton's interpreter; the PyTorch ops
    elsewhere) writes the ring row and moves the counter as ``stage`` of the ``pack`` does: counts
    of either integer dtype, with and without losses, across the ring's end."""
    from esamp.core.backends import triton_records
    from esamp.engines.vllm import step_records as sr

    stores = [RecordStore(torch.device(device), width=40) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    for step in range(sr.RING_ROWS + 5):
        n, units = 1 + step % 17, step % 3
        errors = torch.rand(n, generator=gen).to(device)
        counts = torch.randint(0, 1 << 20, (n,), generator=gen, dtype=(torch.int32, torch.long)[step % 2]).to(device)
        losses = torch.rand(units, generator=gen).to(device) if units else None
        if step == 7:  # a part that is a strided view: the PyTorch ops take it
            errors = torch.rand(2 * n, generator=gen).to(device)[::2]
            assert not triton_records.usable(stores[1]._ring, errors)
        stores[0].stage(RecordStore.pack(errors, counts, losses))
        assert stores[1].stage_parts(errors, counts, losses) == 2 * n + units
        assert torch.equal(stores[0]._ring, stores[1]._ring), step
        assert torch.equal(stores[0]._ring_at, stores[1]._ring_at), step
    with pytest.raises(ValueError, match="holds 40"):
        stores[1].stage_parts(*(torch.zeros(k, device=device) for k in (20, 20, 1)))
    assert torch.equal(stores[0]._ring_at, stores[1]._ring_at)  # refused before anything was written


def test_values_staged_in_one_call_land_as_the_packed_values_do():
    check_stage_parts("cpu")


INTERPRETER_RUNS = {
    "test_the_staging_kernel_lands_the_values_as_the_packed_values_do_in_tritons_interpreter": (
        "import sys; sys.path.insert(0, 'tests/engines'); import test_step_records as t; t.check_stage_parts('cpu')"
    )
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel runs on the GPU there")
def test_the_staging_kernel_lands_the_values_as_the_packed_values_do_in_tritons_interpreter():
    code = INTERPRETER_RUNS["test_the_staging_kernel_lands_the_values_as_the_packed_values_do_in_tritons_interpreter"]
    done = in_tritons_interpreter(code, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.cuda
def test_the_staging_kernel_lands_the_values_as_the_packed_values_do_on_a_gpu():
    check_stage_parts("cuda")


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


@pytest.mark.cuda
def test_a_reader_that_waits_gets_a_busy_gpus_last_records_in_one_take():
    """The records of steps staged behind a long kernel come back in one ``take(wait=...)``,
    and a take that does not wait finds them still copying."""
    store = RecordStore(torch.device("cuda"))
    torch.cuda._sleep(20_000_000)  # some milliseconds of the GPU's time before the values
    for step in range(3):
        packed = RecordStore.pack(torch.full((2,), float(step), device="cuda"), torch.arange(2, device="cuda"), None)
        store.push(step, ["g"] * 2, [0, 1], [step] * 2, packed, [])
    assert store.take() == ([], 3)
    steps, pending = store.take(wait=5.0)
    assert pending == 0 and [r["step"] for r in steps] == [0, 1, 2]


@pytest.mark.cuda
@pytest.mark.parametrize("one_call", [False, True], ids=["packed", "stage_parts"])
def test_values_staged_inside_a_replayed_graph_come_back_as_their_steps_records(one_call):
    """A step captured as a CUDA graph stages its record's values itself (the ring's row is the
    device counter's): replayed with new inputs, each replay's values come back as the record
    pushed after it, across the ring's end and the copies' batches."""
    from esamp.engines.vllm import step_records as sr

    store = RecordStore(torch.device("cuda"), width=8)
    errors = torch.zeros(3, device="cuda")
    counts = torch.zeros(3, dtype=torch.long, device="cuda")
    loss = torch.zeros(1, device="cuda")

    def step():
        if one_call:
            store.stage_parts(errors * 2, counts + 1, loss)
        else:
            store.stage(RecordStore.pack(errors * 2, counts + 1, loss))

    step()  # (warm: the eager call a capture needs first), then no record: forgotten
    store.restart()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    store.restart()  # (the capture ran nothing; a restart with nothing staged changes nothing)
    total = sr.RING_ROWS + 2 * sr.MARK_EVERY + 3
    for s in range(total):
        errors.fill_(s)
        counts.fill_(s % 7)
        loss.fill_(s / 10)
        graph.replay()
        store.push_staged(s, ["g"] * 3, [0, 1, 2], [s] * 3, 7, ["g"])
    torch.cuda.synchronize()
    steps, pending = store.take()
    torch.cuda.synchronize()
    steps += store.take()[0]
    assert [r["step"] for r in steps] == list(range(total))
    for r in steps:
        s = r["step"]
        assert r["rows"] == [("g", i, s, 2.0 * s, s % 7 + 1) for i in range(3)]
        assert r["loss"] == {"g": pytest.approx(s / 10)}
