"""The session controller: owns the engine backend for a screen and turns its events into messages.

The screen never sees a process, a pipe or a thread. It calls ``start``/``restart``/``stop``,
``configure``, ``run`` and ``abort``, and receives typed messages:

- ``EngineLoading``: how far its start has come (a download, a conversion, the load);
- ``EngineReady``: the engine has loaded (its ``ReadyEvent``);
- ``EventBatch``: tokens, steps, dones and per-run errors, in arrival order, at most every
  ``BATCH_SECONDS``, so n panes repaint together at ~10 Hz however fast tokens come (every
  ``BUSY_BATCH_SECONDS`` past ``BUSY_TOKENS_PER_S``, where a frame costs more than its tokens);
- ``EngineFailed``: the engine can take no more work (a fatal error event, the worker died, or
  the backend could not be started).

The backend is anything with ``esamp_tui.worker.Backend``'s methods, built by ``backend_factory``
from a ``SessionSpec``: a worker process (``Session``), which runs the in-process engines or, with
``--server``, the client of a served endpoint (``esamp.engines.endpoint``). Messages carry the
generation of the backend they came from, so a batch from an engine that was replaced meanwhile
is dropped (``current``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from textual.message import Message
from textual.widget import Widget
from textual.worker import get_current_worker

from esamp.core.config import SamplingConfig, Steering
from esamp.engines.base import RateMeter
from esamp.errors import EsampError
from esamp.events import ErrorEvent, Event, LoadingEvent, ReadyEvent
from esamp_tui.worker import Abort, Backend, Configure, RunPrompt, Session, SessionSpec

BATCH_SECONDS = 0.1  # events reach the UI at most 10 times a second: a frame of 8 scrolling panes costs ~30 ms
# Past this many tokens a second, batches come at most every BUSY_BATCH_SECONDS instead: a frame's
# cost is mostly per frame (8 panes scrolled and redrawn), not per token, so at a 7B model's
# 1,000 tok/s fewer, larger batches keep the dashboard's own CPU share down (benchmarks/ui_bench.py).
BUSY_TOKENS_PER_S = 600.0
BUSY_BATCH_SECONDS = 0.25


class SessionController:
    @dataclass
    class EngineReady(Message):
        generation: int
        info: ReadyEvent

    @dataclass
    class EngineLoading(Message):
        generation: int
        progress: LoadingEvent

    @dataclass
    class EventBatch(Message):
        generation: int
        events: list[Event]

    @dataclass
    class EngineFailed(Message):
        generation: int
        error: ErrorEvent

    def __init__(
        self, host: Widget, spec: Callable[[], SessionSpec], backend_factory: Callable[[SessionSpec], Backend] = Session
    ) -> None:
        self.host = host  # receives the messages and runs the reader thread
        self.spec = spec  # called at every (re)start, so a fresh engine gets the current settings
        self.backend_factory = backend_factory
        self.backend: Backend | None = None
        self.generation = 0
        self.ready: ReadyEvent | None = None
        self.failed: ErrorEvent | None = None
        self.log_file: str | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self.generation += 1
        self.ready = self.failed = None
        spec = self.spec()
        self.log_file = spec.log_file
        self.backend = self.backend_factory(spec)
        generation, backend = self.generation, self.backend
        self.host.run_worker(
            lambda: self._pump(backend, generation),
            thread=True,
            group="engine-reader",
            exit_on_error=False,
            description="engine events",
        )

    def stop(self) -> None:
        """Let the current engine go; the close (which may wait for it) runs in a thread."""
        backend, self.backend = self.backend, None
        self.generation += 1  # whatever it still sends is stale
        if backend is not None:
            self.host.run_worker(
                backend.close, thread=True, group="engine-close", exit_on_error=False, description="stop engine"
            )

    def restart(self) -> None:
        self.stop()
        self.start()

    def close_now(self) -> None:
        """Quitting: stop the engine without waiting for a step in flight."""
        backend, self.backend = self.backend, None
        self.generation += 1
        if backend is not None:
            backend.close(timeout=0.5)

    def current(self, message: EngineReady | EventBatch | EngineFailed) -> bool:
        return message.generation == self.generation

    @property
    def usable(self) -> bool:
        return self.backend is not None and self.failed is None

    # -- commands -------------------------------------------------------------------------------

    def configure(self, steering: Steering, sampling: SamplingConfig) -> None:
        """Settings for the next runs; with no engine they reach the next one through its spec."""
        if self.usable:
            self.backend.send(Configure(steering, sampling))

    def run(self, run_id: int, prompt: str, compare: bool = False) -> bool:
        """Start a run; False when there is no engine to run it."""
        if not self.usable:
            return False
        self.backend.send(RunPrompt(run_id, prompt, compare))
        return True

    def abort(self) -> None:
        if self.usable:
            self.backend.send(Abort())

    # -- the reader thread ----------------------------------------------------------------------

    def _post(self, message: Message) -> None:
        self.host.post_message(message)

    def _pump(self, backend: Backend, generation: int) -> None:
        """Start the backend, then batch its events into messages until it ends."""
        worker = get_current_worker()
        batch: list[Event] = []
        first = 0.0  # when the oldest event of ``batch`` arrived
        interval = BATCH_SECONDS
        rate = RateMeter(window_s=1.0)  # the stream's recent tokens a second

        def flush() -> None:
            nonlocal batch, interval
            if batch:
                self._post(self.EventBatch(generation, batch))
                busy = rate.add(sum(1 for e in batch if e.type == "token")) > BUSY_TOKENS_PER_S
                interval = BUSY_BATCH_SECONDS if busy else BATCH_SECONDS
                batch = []

        try:
            backend.start()
            while not worker.is_cancelled:
                wait = interval - (time.monotonic() - first) if batch else interval
                got = backend.read(timeout=max(wait, 0.005))
                for event in got or ():
                    if isinstance(event, LoadingEvent):
                        self._post(self.EngineLoading(generation, event))
                    elif isinstance(event, ReadyEvent):
                        if generation == self.generation:
                            self.ready = event
                        self._post(self.EngineReady(generation, event))
                    elif isinstance(event, ErrorEvent) and event.fatal:
                        flush()  # what came before the failure lands first
                        self._fail(generation, event)
                    else:
                        if not batch:
                            first = time.monotonic()
                        batch.append(event)
                if got is None:
                    flush()
                    self._fail(generation, backend.lost())
                    return
                if batch and time.monotonic() - first >= interval:
                    flush()
        except EsampError as exc:  # e.g. a script without its __main__ guard: its own words
            flush()
            self._fail(generation, ErrorEvent(message=exc.message, hint=exc.hint, fatal=True))
        except Exception as exc:  # the backend could not start or broke: say so, never crash the UI
            flush()
            self._fail(
                generation,
                ErrorEvent(
                    message=f"could not run the engine: {type(exc).__name__}: {exc}",
                    hint="press ctrl+r to try again",
                    fatal=True,
                ),
            )

    def _fail(self, generation: int, error: ErrorEvent) -> None:
        if generation == self.generation and self.failed is None:
            self.failed = error  # set here too, so a command sent before the message lands is refused
            self._post(self.EngineFailed(generation, error))
