"""Run an engine in a spawned worker process: commands in, events out.

The dashboard (and any other long-lived client) talks to an engine only through a ``Session``:

    session = Session(SessionSpec(engine="reference"))
    session.start()
    session.send(RunPrompt(run_id=1, prompt="Name a colour"))
    while (events := session.read(0.1)) is not None: ...
    session.close()

Why a process: CUDA does not survive ``fork`` and a model load or a decode step must never block
the UI's event loop, so the engine lives in a ``spawn``ed child.  The child exits when it is told
to (``Shutdown``), when its parent disappears (checked between steps, so a killed terminal leaves
nothing behind), or when the engine fails fatally (after sending an ``ErrorEvent(fatal=True)``).

Channels: commands go down a ``multiprocessing.Queue`` (``send`` never blocks the caller); events
come up a one-way ``Pipe`` as one pickled list per engine step, written synchronously, so every
event emitted before a crash — even a segfault — has reached the parent, and a reader that falls
behind slows the engine instead of growing an unbounded buffer.  EOF on the pipe means the child
has exited; ``read`` then returns ``None``.

Group keys name the run and whether ESamp steers it: ``r7-on`` / ``r7-off``.  Compare mode starts
both for the same prompt and seed, so two rows of samples decode side by side in one batch loop.

This module never imports textual; the engine is imported only inside the child.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from esamp.core.config import EsampConfig, SamplingConfig, make_config, update_config
from esamp.errors import EsampError
from esamp.events import ErrorEvent, Event

# -- commands ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunPrompt:
    """Start a run: one group with the current ESamp setting, or two (off and on) to compare.

    Any run still decoding is aborted first; its samples end with ``finish_reason="abort"``.
    """

    run_id: int
    prompt: str
    compare: bool = False


@dataclass(frozen=True)
class Abort:
    """Abort every running group."""


@dataclass(frozen=True)
class SetEsamp:
    enabled: bool


@dataclass(frozen=True)
class SetBeta:
    beta: float


@dataclass(frozen=True)
class SetSamples:
    n: int


@dataclass(frozen=True)
class Shutdown:
    pass


Command = Union[RunPrompt, Abort, SetEsamp, SetBeta, SetSamples, Shutdown]


def group_key(run_id: int, esamp_on: bool) -> str:
    return f"r{run_id}-{'on' if esamp_on else 'off'}"


def parse_group_key(key: str) -> tuple[int, bool] | None:
    """``r7-on`` → (7, True); None for a key this module did not make."""
    head, _, tail = key.partition("-")
    if not head.startswith("r") or not head[1:].isdigit() or tail not in ("on", "off"):
        return None
    return int(head[1:]), tail == "on"


# -- what the child needs to build its engine -------------------------------------------------


@dataclass(frozen=True)
class SessionSpec:
    """Everything the worker needs; plain data so it pickles into a spawned process.

    ``engine_factory`` ("package.module:callable") replaces ``create_engine`` — tests use it to
    run a scripted engine through the real process and queues.
    """

    engine: str = "reference"
    model: str | None = None
    esamp: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    engine_factory: str | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)
    log_file: str | None = None  # the child's stdout/stderr go here, never to the UI's terminal; "" = nowhere

    def configs(self) -> tuple[EsampConfig, SamplingConfig]:
        return make_config(EsampConfig, **self.esamp), make_config(SamplingConfig, **self.sampling)


def default_log_file() -> Path:
    root = Path(os.environ.get("ESAMP_CACHE_DIR") or Path.home() / ".cache" / "esamp")
    return root / "tui-worker.log"


def _traceback_tail(lines: int = 12) -> str:
    return "".join(traceback.format_exc().splitlines(keepends=True)[-lines:])


def _build_engine(spec: SessionSpec, esamp: EsampConfig):
    if spec.engine_factory:
        module_name, _, attr = spec.engine_factory.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
        return factory(model=spec.model, esamp=esamp, **spec.engine_options)
    from esamp.engines import create_engine

    return create_engine(spec.engine, model=spec.model, esamp=esamp, **spec.engine_options)


# -- the child --------------------------------------------------------------------------------


class _Worker:
    """The child's loop: apply commands, step the engine, ship each step's events as one list."""

    def __init__(self, spec: SessionSpec, commands, events, parent_pid: int) -> None:
        self.spec = spec
        self.commands = commands
        self.events = events
        self.parent_pid = parent_pid
        self.esamp, self.sampling = spec.configs()
        self.engine = None
        self.running: list[str] = []  # group keys of the current run (finished ones abort as no-ops)

    def emit(self, events: list[Event]) -> None:
        # A pipe, written synchronously: what was emitted before a crash (even a segfault) has
        # reached the parent, and a slow reader slows the engine instead of growing a buffer.
        if events:
            self.events.send(events)

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def run(self) -> int:
        try:
            self.engine = _build_engine(self.spec, self.esamp)
        except EsampError as exc:
            self.emit([ErrorEvent(message=exc.message, hint=exc.hint, fatal=True)])
            return 3
        except Exception as exc:
            self.emit([ErrorEvent(
                message=f"the engine failed to start: {type(exc).__name__}: {exc}",
                hint="check --model and --engine; the traceback is below and in "
                     f"{self.spec.log_file or 'the worker log'}",
                fatal=True, detail=_traceback_tail(),
            )])
            return 3
        self.emit([self.engine.ready])
        try:
            return self.loop()
        finally:
            try:
                self.engine.close()
            except Exception:
                pass

    def loop(self) -> int:
        while self.parent_alive():
            busy = self.engine.has_unfinished()
            for command in self.pending_commands(block=not busy):
                if isinstance(command, Shutdown):
                    return 0
                self.apply(command)
            if not self.engine.has_unfinished():
                continue
            try:
                self.emit(self.engine.step())
            except Exception as exc:
                self.emit([ErrorEvent(
                    message=f"the engine failed while generating: {type(exc).__name__}: {exc}",
                    hint="press the restart key to start a fresh engine; transcripts stay on screen",
                    fatal=True, detail=_traceback_tail(),
                )])
                return 1
        return 0  # the parent is gone: nobody is listening

    def pending_commands(self, block: bool) -> list[Command]:
        out: list[Command] = []
        try:
            out.append(self.commands.get(timeout=0.2) if block else self.commands.get_nowait())
            while True:
                out.append(self.commands.get_nowait())
        except queue.Empty:
            pass
        return out

    def apply(self, command: Command) -> None:
        try:
            if isinstance(command, RunPrompt):
                self.start_run(command)
            elif isinstance(command, Abort):
                self.abort_all()
            elif isinstance(command, SetEsamp):
                self.esamp = update_config(self.esamp, enabled=command.enabled)
            elif isinstance(command, SetBeta):
                self.esamp = update_config(self.esamp, beta=command.beta)
            elif isinstance(command, SetSamples):
                self.sampling = update_config(self.sampling, n=command.n)
            else:
                raise EsampError(f"unknown command {command!r}", hint="this is a bug in the client")
        except EsampError as exc:
            self.emit([ErrorEvent(message=exc.message, hint=exc.hint)])

    def abort_all(self) -> None:
        for key in self.running:
            self.emit(self.engine.abort(key))
        self.running = []

    def start_run(self, command: RunPrompt) -> None:
        self.abort_all()
        modes = (False, True) if command.compare else (self.esamp.enabled,)
        for on in modes:
            key = group_key(command.run_id, on)
            esamp = update_config(self.esamp, enabled=on)
            try:
                self.engine.start(command.prompt, self.sampling, esamp, group=key)
                self.running.append(key)
            except EsampError as exc:
                self.emit([ErrorEvent(message=exc.message, hint=exc.hint, group=key)])


def worker_main(spec: SessionSpec, commands, events, parent_pid: int) -> None:
    """Entry point of the spawned child."""
    # Ctrl-C in the terminal reaches the whole foreground process group; the parent decides when
    # the worker stops (Shutdown, or its own death), so the child ignores SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (Session.close's second step) unwinds through ``engine.close()``, so an engine
    # with processes of its own (vLLM's engine core) can stop them before this one goes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if spec.log_file is not None:  # "" sends the child's output nowhere
        try:
            target = spec.log_file or os.devnull
            if spec.log_file:
                Path(target).parent.mkdir(parents=True, exist_ok=True)
            log = open(target, "a", buffering=1, encoding="utf-8")
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            sys.stdout = sys.stderr = log
            print(f"--- esamp worker {os.getpid()} started {time.strftime('%Y-%m-%d %H:%M:%S')}")
        except OSError:
            pass  # logging is a convenience; the events still carry every error
    try:
        code = _Worker(spec, commands, events, parent_pid).run()
    except (BrokenPipeError, EOFError, OSError):
        code = 0  # the parent closed its end: nobody is listening any more
    except SystemExit as exc:  # SIGTERM, after the engine was closed on the way out
        code = exc.code if isinstance(exc.code, int) else 1
    try:
        sys.stdout.flush()
    except Exception:
        pass
    os._exit(code)


# -- the parent's handle ----------------------------------------------------------------------


def _ensure_resource_tracker() -> None:
    """Start multiprocessing's resource tracker with a real stderr.

    The tracker is spawned with ``sys.stderr.fileno()``; inside a Textual app ``sys.stderr`` is a
    capture object whose descriptor is not valid, and the first ``Queue()`` would then fail with
    "bad value(s) in fds_to_keep". The real stderr (or /dev/null) is lent for that one call.
    """
    from multiprocessing import resource_tracker

    saved = sys.stderr
    real = sys.__stderr__
    try:
        real.fileno()
    except Exception:
        real = open(os.devnull, "w")
    try:
        sys.stderr = real
        resource_tracker.ensure_running()
    finally:
        sys.stderr = saved


class Session:
    """The parent's handle on one worker process. Not thread-safe for ``send`` vs ``close``."""

    def __init__(self, spec: SessionSpec) -> None:
        spec.configs()  # validate here, so a bad setting fails before a process is spawned
        self.spec = spec
        _ensure_resource_tracker()
        self._ctx = mp.get_context("spawn")
        self._commands = self._ctx.Queue()
        self._events, self._events_child = self._ctx.Pipe(duplex=False)  # (read end, write end)
        self._process = None
        self._closed = False

    def start(self) -> "Session":
        # Not a daemon: vLLM starts an engine-core process of its own, which a daemonic process
        # may not do. The child still never outlives us: close() stops it, and it exits by
        # itself when this process disappears (see _Worker.parent_alive).
        self._process = self._ctx.Process(
            target=worker_main, name="esamp-worker", daemon=False,
            args=(self.spec, self._commands, self._events_child, os.getpid()),
        )
        self._process.start()
        self._events_child.close()  # only the child writes; EOF then means the child is gone
        # multiprocessing joins non-daemonic children at exit; a session nobody closed would
        # then wait forever for a child that waits for its parent. Close it first (LIFO).
        atexit.register(self.close)
        return self

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def alive(self) -> bool:
        return bool(self._process and self._process.is_alive())

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode if self._process else None

    def send(self, command: Command) -> None:
        if self._closed:
            raise EsampError("the session is closed", hint="start a new session")
        self._commands.put(command)

    def read(self, timeout: float = 0.1) -> list[Event] | None:
        """Every event available now, waiting up to ``timeout`` for the first.

        Returns ``[]`` when nothing arrived, and ``None`` once the worker has exited and its
        queue is drained (the caller then looks at ``exitcode``).
        """
        out: list[Event] = []
        try:
            if self._events.poll(timeout):
                out.extend(self._events.recv())
                while self._events.poll(0):
                    out.extend(self._events.recv())
        except (EOFError, OSError, ValueError):  # the child's end is closed: it has exited
            if self._process is not None:
                self._process.join(1.0)
            return out or None
        return out

    def close(self, timeout: float = 3.0) -> None:
        """Stop the worker: ask, then terminate, then kill. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        proc = self._process
        if proc is not None and proc.is_alive():
            try:
                self._commands.put(Shutdown())
            except Exception:
                pass
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()  # the child closes its engine on SIGTERM, then exits
                proc.join(3.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        self._commands.cancel_join_thread()
        self._commands.close()
        self._events.close()
