"""Run an engine in a spawned worker process: commands in, events out.

A long-lived client (the dashboard) talks to an engine only through a ``Backend``: it sends
commands and reads events. ``Session`` is the backend that runs the engine in a child process:

    session = Session(SessionSpec(engine="reference"))
    session.start()
    session.send(Configure(steering, sampling))   # typed settings, as esamp.core.config defines them
    session.send(RunPrompt(run_id=1, prompt="Name a colour"))
    while (events := session.read(0.1)) is not None: ...
    session.close()

A client of a served endpoint would be a second ``Backend`` taking the same commands.

Why a process: CUDA does not survive ``fork`` and a model load or a decode step must never block
the UI's event loop, so the engine lives in a ``spawn``ed child. The child exits when it is told
to (``Shutdown``), when the engine fails fatally (after an ``ErrorEvent(fatal=True)``), or when its
parent disappears: a watchdog thread notices within half a second, even while the model is
still loading, so a killed dashboard never leaves a worker spinning behind it.

One request never takes the engine down: an error while starting or stepping a run ends that
run's samples with ``finish_reason="error"`` after an ``ErrorEvent`` naming the group (reason,
hint, traceback tail), and the worker goes on serving the next prompt. Only an engine that cannot
start, or cannot even abort a failed run, is fatal.

Channels are two one-way pipes; no ``multiprocessing.Queue``, whose named semaphores outlive a
process that is killed and are then reported as "leaked" at exit. Events come up as one pickled
list per engine step, written synchronously, so every event emitted before a crash (even a
segfault) has reached the parent, and a reader that falls behind slows the engine instead of
growing a buffer. Commands go down through a sender thread, so ``send`` never blocks the caller
even while the child is busy loading a model. EOF on the event pipe means the child has exited.

Group keys name the run and whether ESamp steers it: ``r7-on`` / ``r7-off``. Compare mode starts
both for the same prompt and seed, so two rows of samples decode side by side in one batch loop.

This module never imports textual; the engine is imported only inside the child.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from esamp.core.config import EsampConfig, SamplingConfig, Steering, update_config
from esamp.engines import DEFAULT_ENGINE
from esamp.engines.base import group_key
from esamp.engines.models import cache_dir
from esamp.errors import EsampError
from esamp.events import DoneEvent, ErrorEvent, Event, TokenEvent
from esamp.platform.spawn import check_main_guard

# -- commands ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunPrompt:
    """Start a run with the current settings: one group, or two (ESamp off and on) to compare.

    Any run still decoding is aborted first; its samples end with ``finish_reason="abort"``.
    """

    run_id: int
    prompt: str
    compare: bool = False


@dataclass(frozen=True)
class Configure:
    """The settings of the runs that follow: how ESamp steers them and how each group samples."""

    steering: Steering
    sampling: SamplingConfig


@dataclass(frozen=True)
class Abort:
    """Abort every running group."""


@dataclass(frozen=True)
class Shutdown:
    pass


Command = RunPrompt | Configure | Abort | Shutdown


def run_group_key(run_id: int, esamp_on: bool) -> str:
    """A dashboard run's group for one ESamp state (``r3-on``)."""
    return group_key(f"r{run_id}", "on" if esamp_on else "off")


# -- what the child needs to build its engine -------------------------------------------------


@dataclass(frozen=True)
class SessionSpec:
    """Everything the worker needs; it pickles into the spawned process as it is.

    ``esamp`` holds the engine-wide Distiller settings and the steering of the first runs,
    ``sampling`` the first runs' sampling; ``Configure`` changes both later. ``engine_factory``
    ("package.module:callable") replaces ``create_engine``: tests run a scripted engine through
    the real process and pipes with it.
    """

    engine: str = DEFAULT_ENGINE
    model: str | None = None
    esamp: EsampConfig = field(default_factory=EsampConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine_factory: str | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)
    log_file: str | None = None  # the child's stdout/stderr go here, never to the UI's terminal; "" = nowhere


def default_log_file() -> Path:
    return cache_dir() / "tui-worker.log"


def _traceback_tail(lines: int = 12) -> str:
    return "".join(traceback.format_exc().splitlines(keepends=True)[-lines:])


def _build_engine(spec: SessionSpec, progress):
    """The spec's engine; ``progress`` hears of its start (a download, a conversion, the load)."""
    if spec.engine_factory:
        module_name, _, attr = spec.engine_factory.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
        options = dict(spec.engine_options)
        if "progress" in inspect.signature(factory).parameters:
            options["progress"] = progress
        return factory(model=spec.model, esamp=spec.esamp, **options)
    from esamp.engines import create_engine

    return create_engine(spec.engine, model=spec.model, esamp=spec.esamp, progress=progress, **spec.engine_options)


def _failure(exc: BaseException, what: str, hint: str, group: str | None = None, fatal: bool = False) -> ErrorEvent:
    """An error event for ``exc``: a user's error as it is, anything else with its traceback."""
    if isinstance(exc, EsampError):
        return ErrorEvent(message=exc.message, hint=exc.hint, group=group, fatal=fatal)
    return ErrorEvent(
        message=f"{what}: {type(exc).__name__}: {exc}", hint=hint, group=group, fatal=fatal, detail=_traceback_tail()
    )


# -- the child --------------------------------------------------------------------------------


class _Worker:
    """The child's loop: apply commands, step the engine, ship each step's events as one list."""

    def __init__(self, spec: SessionSpec, commands, events, parent_pid: int) -> None:
        self.spec = spec
        self.commands = commands
        self.events = events
        self.parent_pid = parent_pid
        self.steering: Steering = spec.esamp.steering
        self.sampling: SamplingConfig = spec.sampling
        self.engine = None
        self.running: dict[str, dict[int, int]] = {}  # group key → {open sample: tokens sent}
        self.log_hint = f"the traceback is below and in {spec.log_file or 'the worker log'}"

    def emit(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, TokenEvent) and event.sample in self.running.get(event.group, ()):
                self.running[event.group][event.sample] += 1
            elif isinstance(event, DoneEvent) and event.group in self.running:
                self.running[event.group].pop(event.sample, None)
        if events:
            self.events.send(events)

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def run(self) -> int:
        try:
            self.engine = _build_engine(self.spec, lambda event: self.emit([event]))
        except Exception as exc:
            self.emit(
                [
                    _failure(
                        exc, "the engine failed to start", f"check --model and --engine; {self.log_hint}", fatal=True
                    )
                ]
            )
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
                if not self.fail_run(exc):
                    return 1
        return 0  # the parent is gone: nobody is listening

    def pending_commands(self, block: bool) -> list[Command]:
        out: list[Command] = []
        try:
            if self.commands.poll(0.2 if block else 0):
                out.append(self.commands.recv())
                while self.commands.poll(0):
                    out.append(self.commands.recv())
        except (EOFError, OSError):  # the parent closed its end
            out.append(Shutdown())
        return out

    def apply(self, command: Command) -> None:
        if isinstance(command, RunPrompt):
            self.start_run(command)
        elif isinstance(command, Abort):
            self.abort_all()
        elif isinstance(command, Configure):
            self.steering, self.sampling = command.steering, command.sampling
        else:
            self.emit([ErrorEvent(message=f"unknown command {command!r}", hint="this is a bug in the client")])

    def abort_all(self) -> None:
        for key in self.running:
            self.emit(self.engine.abort(key))
        self.running = {}

    def start_run(self, command: RunPrompt) -> None:
        self.abort_all()
        modes = (False, True) if command.compare else (self.steering.enabled,)
        for on in modes:
            key = run_group_key(command.run_id, on)
            try:
                steering = update_config(self.steering, enabled=on)
                self.engine.start(command.prompt, self.sampling, steering, group=key)
                self.running[key] = dict.fromkeys(range(self.sampling.n), 0)
            except Exception as exc:
                self.discard(key)
                self.emit(
                    [
                        _failure(
                            exc,
                            "the run could not start",
                            f"the engine is still running: try again or another prompt; {self.log_hint}",
                            group=key,
                        ),
                        *self.error_dones(key, dict.fromkeys(range(self.sampling.n), 0)),
                    ]
                )

    def fail_run(self, exc: Exception) -> bool:
        """A step raised: end every running group with an error and keep serving, when the
        engine can still abort them. False when it cannot (the engine is then unusable)."""
        running, self.running = self.running, {}
        events: list[Event] = []
        for key, samples in running.items():
            if samples:
                events.append(
                    _failure(
                        exc,
                        "the run failed while generating",
                        f"the engine is still running: try again or another prompt; {self.log_hint}",
                        group=key,
                    )
                )
                events.extend(self.error_dones(key, samples))
        try:
            for key in running:
                self.engine.abort(key)  # frees the group's slot; its samples were ended above
            healthy = not self.engine.has_unfinished()
        except Exception:
            healthy = False
        if not healthy:
            events.append(
                _failure(
                    exc,
                    "the engine failed while generating",
                    "press ctrl+r to start a fresh engine; transcripts stay on screen",
                    fatal=True,
                )
            )
        self.emit(events)
        return healthy

    def discard(self, key: str) -> None:
        """Forget whatever a failed start left behind (its events never reach the client)."""
        try:
            self.engine.abort(key)
        except Exception:
            pass

    @staticmethod
    def error_dones(key: str, samples: dict[int, int]) -> list[Event]:
        """The end of each sample still open, with the tokens it had sent."""
        return [DoneEvent(group=key, sample=s, finish_reason="error", tokens=n) for s, n in sorted(samples.items())]


def _watch_parent(parent_pid: int, interval: float = 0.5, grace: float = 5.0) -> None:
    """Stop this process once its parent is gone, whatever the main thread is doing.

    The main thread may be inside a model load for many seconds; SIGTERM unwinds it through
    ``engine.close()`` at the next bytecode. A main thread stuck in native code is ended after
    ``grace`` seconds.
    """
    while os.getppid() == parent_pid:
        time.sleep(interval)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace)
    os._exit(1)


def worker_main(spec: SessionSpec, commands, events, parent_pid: int) -> None:
    """Entry point of the spawned child."""
    from esamp.platform.threads import prefer_passive_wait

    prefer_passive_wait()  # before the engine loads torch (docs/models.md, "Threads on a CPU")
    # Ctrl-C in the terminal reaches the whole foreground process group; the parent decides when
    # the worker stops (Shutdown, or its own death), so the child ignores SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (Session.close's second step, or the watchdog) unwinds through ``engine.close()``,
    # so an engine with processes of its own (vLLM's engine core) can stop them first.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="esamp-parent-watch", daemon=True).start()
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
    _release_named_resources()
    os._exit(code)


def _release_named_resources() -> None:
    """Run multiprocessing's exit-time finalizers, which ``os._exit`` skips.

    Libraries in the worker create named semaphores: tqdm's progress-bar lock (a
    ``multiprocessing.RLock`` kept for the process's life; the first start's model conversion
    draws a bar) is one. Each is registered with the resource tracker this process shares with
    the dashboard and unlinked by a finalizer at a normal exit. Skipped, the tracker unlinks it
    when the dashboard exits and prints "leaked semaphore objects" on the user's terminal. These
    finalizers (priority 0 and up) release and close; they do not wait for child processes.
    """
    from multiprocessing import util

    try:
        util._run_finalizers(0)  # what a normal exit of a multiprocessing child runs first
    except Exception:
        pass


# -- the parent's side ------------------------------------------------------------------------


class Backend(Protocol):
    """What a client needs from an engine it does not run in its own process."""

    def start(self) -> Backend: ...

    def send(self, command: Command) -> None:
        """Queue a command; never blocks."""

    def read(self, timeout: float = 0.1) -> list[Event] | None:
        """Events available now (waiting up to ``timeout``); None once the engine has gone."""

    def lost(self) -> ErrorEvent:
        """Why the engine went away without a fatal error event of its own."""

    def close(self, timeout: float = 3.0) -> None: ...


def _ensure_resource_tracker() -> None:
    """Start multiprocessing's resource tracker with a real stderr.

    ``spawn`` starts the tracker with ``sys.stderr.fileno()``; inside a Textual app ``sys.stderr``
    is a capture object whose descriptor is not valid, and the start would then fail with "bad
    value(s) in fds_to_keep". The real stderr (or /dev/null) is lent for that one call.
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
    """The parent's handle on one worker process (a ``Backend``)."""

    def __init__(self, spec: SessionSpec) -> None:
        self.spec = spec
        _ensure_resource_tracker()
        self._ctx = mp.get_context("spawn")
        self._commands_child, self._commands = self._ctx.Pipe(duplex=False)  # (read end, write end)
        self._events, self._events_child = self._ctx.Pipe(duplex=False)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._process = None
        self._closed = False

    def start(self) -> Session:
        check_main_guard("the dashboard's engine process")
        # Not a daemon: vLLM starts an engine-core process of its own, which a daemonic process
        # may not do. The child still never outlives us: close() stops it, and it stops itself
        # when this process disappears (see _watch_parent).
        self._process = self._ctx.Process(
            target=worker_main,
            name="esamp-worker",
            daemon=False,
            args=(self.spec, self._commands_child, self._events_child, os.getpid()),
        )
        self._process.start()
        # Only the child reads commands and writes events: EOF then means the child is gone.
        self._commands_child.close()
        self._events_child.close()
        self._sender = threading.Thread(target=self._send_loop, name="esamp-commands", daemon=True)
        self._sender.start()
        # multiprocessing joins non-daemonic children at exit; a session nobody closed would
        # then wait for a child that waits for its parent. Close it first (LIFO).
        atexit.register(self.close)
        return self

    def _send_loop(self) -> None:
        while (command := self._outbox.get()) is not None:
            try:
                self._commands.send(command)
            except (OSError, ValueError):  # the child has gone; read() reports it
                return

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
        self._outbox.put(command)

    def read(self, timeout: float = 0.1) -> list[Event] | None:
        """Every event available now, waiting up to ``timeout`` for the first.

        Returns ``[]`` when nothing arrived, and ``None`` once the worker has exited and its
        pipe is drained (``lost`` then says how it ended).
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

    def lost(self) -> ErrorEvent:
        code = self.exitcode
        reason = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        log = f"; the worker's output is in {self.spec.log_file}" if self.spec.log_file else ""
        return ErrorEvent(
            message=f"the engine process stopped unexpectedly ({reason})",
            hint="press ctrl+r to start a fresh engine" + log,
            fatal=True,
        )

    def close(self, timeout: float = 3.0) -> None:
        """Stop the worker: ask, then terminate, then kill; close both pipes. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        proc = self._process
        if proc is not None and proc.is_alive():
            self._outbox.put(Shutdown())
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()  # the child closes its engine on SIGTERM, then exits
                proc.join(3.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        self._outbox.put(None)
        if self._sender is not None:
            self._sender.join(1.0)
        for end in (self._commands, self._events, self._commands_child, self._events_child):
            end.close()
