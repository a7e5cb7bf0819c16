"""The library engine's records channel: a worker thread answers record fetches off vLLM's RPC."""

from __future__ import annotations

import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest

from esamp.engines.vllm import records_channel


class FakeSteering:
    """What the channel reads: ``drain`` from another thread, and its own attribute slot."""

    def __init__(self) -> None:
        self.records_server = None
        self.calls: list[tuple] = []
        self.threads: set[str] = set()

    def drain(self, release=(), groups=None, columns=False, plain=True, wait=0.0) -> dict:
        self.calls.append((tuple(release), groups, columns, plain, wait))
        self.threads.add(threading.current_thread().name)
        return {"steps": [{"step": len(self.calls)}], "pending": 0, "counters": {}, "free_slots": 3, "groups": []}


def test_fetches_come_from_the_workers_thread_and_release_nothing():
    steering = FakeSteering()
    server = records_channel.server_for(steering)
    assert records_channel.server_for(steering) is server  # one server per worker
    conn = records_channel.connect((server.address, server.key))
    for step in (1, 2, 3):
        conn.send(None)
        assert conn.recv()["steps"] == [{"step": step}]
    # every fetch: all groups' records, as columns of arrays (lists are made on the reader's
    # side); a release never goes this way (every TP worker's ledger must free a group: that
    # stays a collective_rpc)
    assert steering.calls == [((), None, True, False, 0.0)] * 3
    assert steering.threads == {"esamp-records-reader"}
    conn.close()  # the engine closes: the server lets go of the steering (an in-process engine's bank)
    for _ in range(200):
        if server.steering is None:
            break
        threading.Event().wait(0.01)
    assert server.steering is None and steering.records_server is None
    assert records_channel.server_for(steering) is not server  # a later ask: a new server


def test_a_client_without_the_key_is_refused_and_the_channel_stays_open():
    steering = FakeSteering()
    server = records_channel.server_for(steering)
    with pytest.raises(AuthenticationError):
        Client(server.address, family="AF_UNIX", authkey=b"not the key")
    conn = records_channel.connect((server.address, server.key))
    conn.send(None)
    assert conn.recv()["free_slots"] == 3


def test_no_channel_means_the_rpc_path():
    """A worker without records answers None; an address that does not open warns and gives None
    (the engine then fetches through ``collective_rpc``, as before)."""
    assert records_channel.connect(None) is None
    assert records_channel.connect(("/nonexistent/esamp-records", b"k" * 32)) is None


def test_the_reader_gets_the_records_as_the_rpc_path_gives_them():
    """The channel sends a record's numbers as arrays (pickled as one copy each, so the worker's
    thread does little while the engine steps) and ``receive`` hands the reader plain lists, the
    same values ``collective_rpc``'s drain gives."""
    import torch

    from esamp.engines.vllm.step_records import RecordStore

    class Steering:
        records_server = None

        def __init__(self) -> None:
            self.records = RecordStore(torch.device("cpu"))

        def drain(self, release=(), groups=None, columns=False, plain=True, wait=0.0) -> dict:
            steps, pending = self.records.take(groups, columns, plain, wait)
            return {"steps": steps, "pending": pending}

    steering = Steering()
    packed = RecordStore.pack(torch.tensor([0.25, 0.5]), torch.tensor([3, 7]), torch.tensor([1.5]))
    steering.records.push(4, ["g", "g"], [0, 1], [5, 5], packed, ["g"])
    server = records_channel.server_for(steering)
    conn = records_channel.connect((server.address, server.key))
    (rec,) = records_channel.receive(conn)["steps"]
    assert rec["columns"] == {
        "groups": ["g", "g"],
        "samples": [0, 1],
        "generated": [5, 5],
        "errors": [0.25, 0.5],
        "candidates": [3, 7],
    }
    assert all(type(c) is int for c in rec["columns"]["candidates"]) and rec["loss"] == {"g": 1.5}
    conn.close()


def test_a_fetch_may_let_the_worker_wait_for_the_copies_in_flight():
    """``receive(conn, wait)`` asks the worker to wait that long at most for the records' copies
    in flight; a request without it (or a malformed one) waits not at all, and no request holds
    the worker's thread longer than ``MAX_WAIT_SECONDS``."""

    class Steering(FakeSteering):
        def drain(self, *args, **kw) -> dict:
            return {**super().drain(*args, **kw), "steps": []}

    steering = Steering()
    server = records_channel.server_for(steering)
    conn = records_channel.connect((server.address, server.key))
    records_channel.receive(conn, 0.02)
    records_channel.receive(conn)
    conn.send({"wait": 60})
    conn.recv()
    conn.send({"wait": "soon"})
    conn.recv()
    assert [c[-1] for c in steering.calls] == [0.02, 0.0, records_channel.MAX_WAIT_SECONDS, 0.0]
    conn.close()
