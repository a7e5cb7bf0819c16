"""The library engine's step records off vLLM's RPC path: a thread of the worker that keeps them.

A ``collective_rpc`` runs in vLLM's engine-core loop, which waits for every worker's answer before
it schedules again, and the workers answer only between two steps: fetched that way, step records
cost ``esamp bench`` about a step each (7% of a 7B trial's time on one GPU, 13–17% under TP = 2;
``docs/benchmarks.md``). So the library engine asks once, through ``collective_rpc``, for this
channel: the worker that owns the records (TP rank 0) opens a local socket
(``multiprocessing.connection`` over a Unix socket in a private temporary folder, with a random
authentication key that only the asking process receives) and a daemon thread answers each fetch
from the lock-protected record store, as ``esamp serve``'s side channel reads it, while the worker
steps on. A fetch may let that thread first wait a little for the records' copies in flight
(``receive``'s ``wait``): the library engine asks so once vLLM has no more outputs for it, and a
run's last records then come back in one fetch instead of two and a pause. A released group
still goes through ``collective_rpc`` (every worker's slot ledger must free it), but only when a
group ends.
"""

from __future__ import annotations

import logging
import secrets
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

from esamp.engines.vllm.step_records import plain_columns

log = logging.getLogger(__name__)
MAX_WAIT_SECONDS = 0.1  # the longest a fetch may hold the worker's thread for copies in flight


class RecordsServer:
    """Serves ``steering.drain(groups=None, columns=True, plain=False)`` to its engine's connection,
    one request at a time: a request is ``None``, the answer the drain's dict (``receive`` on the
    reader's side makes its columns plain lists). When that connection closes the server closes
    too (a later ask starts a new one)."""

    def __init__(self, steering) -> None:
        self.steering = steering
        self.key = secrets.token_bytes(32)
        self.listener = Listener(family="AF_UNIX", authkey=self.key)
        self.address = self.listener.address
        threading.Thread(target=self._accept, name="esamp-records", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except AuthenticationError:
                continue  # a connection without the key is refused; the channel stays open
            except OSError:
                return  # the listener is closed
            threading.Thread(target=self._answer, args=(conn,), name="esamp-records-reader", daemon=True).start()

    def _answer(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    ask = conn.recv()
                except (EOFError, OSError):
                    break  # the client closed: its engine is shutting down
                # The numbers go as arrays (a copy each when pickled) and become lists in the
                # reader's process: this thread shares the engine's interpreter with its steps.
                conn.send(self.steering.drain((), None, True, plain=False, wait=_wait(ask)))
        self.close()

    def close(self) -> None:
        """Stop serving and let go of the steering: an in-process engine's worker (tests, a GPU
        suite) lives on in this process, and its Distiller bank must be freed with the engine."""
        self.listener.close()
        steering, self.steering = self.steering, None
        if steering is not None and steering.records_server is self:
            steering.records_server = None


def server_for(steering) -> RecordsServer:
    """The worker's one records server (started at the first ask)."""
    if steering.records_server is None:
        steering.records_server = RecordsServer(steering)
    return steering.records_server


def _wait(ask) -> float:
    """How long a fetch lets the records' copies in flight finish first: a request is None (not
    at all) or {"wait": seconds}, at most ``MAX_WAIT_SECONDS``."""
    if not isinstance(ask, dict):
        return 0.0
    try:
        return min(max(float(ask.get("wait", 0.0)), 0.0), MAX_WAIT_SECONDS)
    except (TypeError, ValueError):
        return 0.0


def receive(conn: Connection, wait: float = 0.0) -> dict:
    """One fetch's answer, its records' columns as ``steering.drain(columns=True)`` gives them;
    ``wait``: seconds the worker may wait for the copies in flight first (``RecordStore.settle``)."""
    conn.send({"wait": wait} if wait > 0 else None)
    out = conn.recv()
    for rec in out["steps"]:
        rec["columns"] = plain_columns(rec["columns"])
    return out


def connect(answer) -> Connection | None:
    """A client connection from ``esamp_records_channel``'s answer (None: no channel there)."""
    if not answer:
        return None
    address, key = answer
    try:
        return Client(address, family="AF_UNIX", authkey=bytes(key))
    except Exception as exc:  # the records still come, through collective_rpc
        log.warning("ESamp: the records channel did not open (%s); fetching through vLLM's RPC", exc)
        return None
