"""The worker process: commands in, events out, and no process left behind however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from esamp.core.config import SamplingConfig, Steering
from esamp.events import DoneEvent, ErrorEvent, ReadyEvent, TokenEvent
from esamp_tui.worker import Abort, Configure, RunPrompt, Session, SessionSpec

from .fake_engine import FACTORY

ROOT = Path(__file__).resolve().parents[2]


def spec(**values) -> SessionSpec:
    base = dict(engine_factory=FACTORY, sampling=SamplingConfig(n=2, max_tokens=4), log_file="")
    base.update(values)
    return SessionSpec(**base)


def collect(session: Session, until, timeout: float = 10.0) -> list:
    """Read events until ``until(events)`` holds or the worker ends."""
    events: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = session.read(0.05)
        if got is None:
            return events
        events.extend(got)
        if until(events):
            return events
    raise AssertionError(f"timed out; got {[e.type for e in events]}")


def dones(n):
    return lambda events: sum(isinstance(e, DoneEvent) for e in events) >= n


def pid_gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie counts as gone
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().split(") ")[-1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def session():
    s = Session(spec()).start()
    yield s
    s.close()
    assert not s.alive


def test_ready_then_ordered_tokens_and_dones(session):
    events = collect(session, lambda ev: any(isinstance(e, ReadyEvent) for e in ev))
    assert isinstance(events[0], ReadyEvent) and events[0].engine == "fake"
    session.send(RunPrompt(1, "hi"))
    events = collect(session, dones(2))
    for sample in (0, 1):
        mine = [e for e in events if getattr(e, "sample", None) == sample and e.group == "r1-on"]
        tokens = [e for e in mine if isinstance(e, TokenEvent)]
        assert [t.index for t in tokens] == list(range(len(tokens)))  # no gap, no reorder
        assert isinstance(mine[-1], DoneEvent) and mine[-1].tokens == len(tokens)


def test_configure_shapes_the_next_run(session):
    session.send(Configure(Steering(enabled=False), SamplingConfig(n=3, max_tokens=4)))
    session.send(RunPrompt(1, "plain"))
    events = collect(session, dones(3))
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert {t.group for t in tokens} == {"r1-off"}
    assert {t.sample for t in tokens} == {0, 1, 2}
    assert all(t.novelty is None for t in tokens)
    # The steering reaches the engine as sent: the scripted engine writes "un" for this mix.
    session.send(Configure(Steering(mix="unsharpened", beta=1.5), SamplingConfig(n=2, max_tokens=4)))
    session.send(RunPrompt(2, "mixed"))
    events = collect(session, dones(2))
    assert {t.text.split("0")[0] for t in events if isinstance(t, TokenEvent) and t.index == 0} == {"un"}


def test_a_run_that_cannot_start_ends_with_an_error_and_the_engine_serves_on(session):
    session.send(RunPrompt(1, "bad start"))  # start() raises a TypeError, as a tokenizer can
    events = collect(session, dones(2))
    error = next(e for e in events if isinstance(e, ErrorEvent))
    assert error.group == "r1-on" and not error.fatal and "TypeError" in error.message and error.hint
    assert error.detail  # the traceback tail, for the panel
    assert [(e.sample, e.finish_reason) for e in events if isinstance(e, DoneEvent)] == [(0, "error"), (1, "error")]
    pid = session.pid
    session.send(RunPrompt(2, "fine"))
    events = collect(session, dones(2))
    assert {e.finish_reason for e in events if isinstance(e, DoneEvent)} <= {"length", "stop"}
    assert session.pid == pid and session.alive


def test_a_run_that_fails_while_generating_ends_and_the_engine_serves_on(session):
    session.send(RunPrompt(1, "fail", compare=True))  # step() raises on the third step
    events = collect(session, dones(4))
    errors = [e for e in events if isinstance(e, ErrorEvent)]
    assert {e.group for e in errors} == {"r1-off", "r1-on"} and not any(e.fatal for e in errors)
    assert "scripted failure" in errors[0].message and "RuntimeError" in errors[0].detail
    done = [(e.group, e.sample, e.finish_reason) for e in events if isinstance(e, DoneEvent)]
    assert sorted((g, s) for g, s, _ in done) == [(g, s) for g in ("r1-off", "r1-on") for s in (0, 1)]  # one each
    assert {r for _, s, r in done if s == 0} == {"error"}  # sample 1 had stopped before the failure
    sent = {(e.group, e.sample): 0 for e in events if isinstance(e, DoneEvent)}
    for e in events:
        if isinstance(e, TokenEvent):
            sent[e.group, e.sample] += 1
    assert all(e.tokens == sent[e.group, e.sample] for e in events if isinstance(e, DoneEvent))
    session.send(RunPrompt(2, "again"))
    events = collect(session, dones(2))
    assert all(e.finish_reason in ("length", "stop") for e in events if isinstance(e, DoneEvent))
    assert not any(isinstance(e, ErrorEvent) for e in events)


def test_no_named_semaphores(monkeypatch):
    """Pipes only: a named semaphore outlives a killed process and is reported as leaked."""
    import multiprocessing.synchronize

    made = []
    original = multiprocessing.synchronize.SemLock.__init__
    monkeypatch.setattr(
        multiprocessing.synchronize.SemLock, "__init__", lambda self, *a, **k: made.append(a) or original(self, *a, **k)
    )
    s = Session(spec()).start()
    try:
        collect(s, lambda ev: any(isinstance(e, ReadyEvent) for e in ev))
        s.send(RunPrompt(1, "hi"))
        collect(s, dones(2))
    finally:
        s.close()
    assert made == []


def test_compare_runs_off_and_on_together(session):
    session.send(RunPrompt(4, "both", compare=True))
    events = collect(session, dones(4))
    groups = {e.group for e in events if isinstance(e, TokenEvent)}
    assert groups == {"r4-off", "r4-on"}


def test_abort_and_a_new_run_replaces_the_old(session):
    session.send(RunPrompt(1, "a", compare=False))
    session.send(RunPrompt(2, "b"))  # aborts run 1 first
    events = collect(session, lambda ev: sum(isinstance(e, DoneEvent) and e.group == "r2-on" for e in ev) == 2)
    run1 = [e for e in events if isinstance(e, DoneEvent) and e.group == "r1-on"]
    assert len(run1) == 2
    session.send(Abort())  # nothing running: harmless


def test_model_not_found_is_a_fatal_error_then_exit():
    s = Session(spec(model="missing")).start()
    try:
        events = collect(s, lambda ev: False, timeout=10)  # until the worker ends
        assert len(events) == 1 and isinstance(events[0], ErrorEvent) and events[0].fatal
        assert "looked in" in events[0].message and events[0].hint
        assert s.exitcode == 3
    finally:
        s.close()


def test_crash_mid_stream_keeps_what_was_sent():
    s = Session(spec()).start()
    try:
        s.send(RunPrompt(1, "crash"))
        events = collect(s, lambda ev: False, timeout=10)
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert len(tokens) == 2 * 2  # two steps of two samples arrived before the death
        assert s.exitcode == 9
    finally:
        s.close()


def test_close_stops_a_busy_worker():
    s = Session(spec(sampling=SamplingConfig(n=2, max_tokens=30_000), engine_options=dict(delay=0.01))).start()
    s.send(RunPrompt(1, "forever"))
    collect(s, lambda ev: any(isinstance(e, TokenEvent) for e in ev))
    pid = s.pid
    t0 = time.monotonic()
    s.close(timeout=2.0)
    assert time.monotonic() - t0 < 4 and pid_gone(pid)


PARENT = textwrap.dedent("""
    import sys, time
    sys.path[:0] = {paths!r}
    from esamp.core.config import SamplingConfig
    from esamp_tui.worker import Session, SessionSpec, RunPrompt
    from tui.fake_engine import FACTORY
    if __name__ == "__main__":
        s = Session(SessionSpec(engine_factory=FACTORY, log_file="",
                                sampling=SamplingConfig(n=2, max_tokens=30000),
                                engine_options=dict(delay=0.01))).start()
        s.send(RunPrompt(1, "forever"))
        while not s.read(0.1):
            pass
        print(s.pid, flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGHUP, signal.SIGTERM])
def test_worker_dies_with_its_parent(tmp_path, how):
    """A killed dashboard (closed terminal, kill -9) leaves no worker behind."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(paths=[str(ROOT / "tests"), str(ROOT)]))
    # SIGHUP at its default, as a terminal starts the dashboard, even when the tests run under nohup
    parent = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )
    try:
        worker_pid = int(parent.stdout.readline())
        parent.send_signal(how)
        parent.wait(10)
        assert pid_gone(worker_pid, timeout=5.0), f"worker {worker_pid} outlived its parent"
    finally:
        parent.kill()
        parent.wait()


FORGETFUL = textwrap.dedent("""
    import sys
    sys.path[:0] = {paths!r}
    from esamp.core.config import SamplingConfig
    from esamp_tui.worker import Session, SessionSpec, RunPrompt
    from tui.fake_engine import FACTORY
    if __name__ == "__main__":
        s = Session(SessionSpec(engine_factory=FACTORY, log_file="",
                                sampling=SamplingConfig(n=2, max_tokens=30000),
                                engine_options=dict(delay=0.01))).start()
        s.send(RunPrompt(1, "forever"))
        while not s.read(0.1):
            pass
        print(s.pid, flush=True)
        # exits without close(): the worker (not a daemon) must not keep us waiting
""")


def test_exit_without_close_neither_hangs_nor_leaves_the_worker(tmp_path):
    script = tmp_path / "forgetful.py"
    script.write_text(FORGETFUL.format(paths=[str(ROOT / "tests"), str(ROOT)]))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert pid_gone(int(result.stdout.strip()), timeout=5.0)


COLD_START = textwrap.dedent("""
    import sys, time
    sys.path[:0] = {paths!r}
    from esamp_tui.worker import Session, SessionSpec
    from tui.fake_engine import FACTORY
    if __name__ == "__main__":
        s = Session(SessionSpec(engine_factory=FACTORY, log_file="", engine_options=dict(load_seconds=60))).start()
        print(s.pid, flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_no_orphan_when_the_parent_dies_during_a_cold_start(tmp_path, how):
    """The worker notices its parent is gone while it is still loading the model (a busy CPU
    loop here, as a load is), not only once it reads commands."""
    script = tmp_path / "cold.py"
    script.write_text(COLD_START.format(paths=[str(ROOT / "tests"), str(ROOT)]))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(parent.stdout.readline())
        time.sleep(1.5)  # the worker is spinning in its "load" now
        parent.send_signal(how)
        parent.wait(10)
        assert pid_gone(worker_pid, timeout=4.0), f"worker {worker_pid} outlived its parent during the load"
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.slow
def test_distiller_flag_reaches_the_engine(monkeypatch):
    """``esamp-tui --distiller shared``: the engine the worker builds has one shared Distiller."""
    import esamp_tui.__main__ as tui
    from esamp_tui.worker import _build_engine

    seen = {}
    monkeypatch.setattr(tui, "run_app", lambda options: seen.setdefault("options", options) and 0)
    assert tui.main(["--engine", "reference", "--distiller", "shared"]) == 0
    options = seen["options"]
    engine = _build_engine(options.session_spec(options.esamp.steering, options.sampling), progress=lambda event: None)
    try:
        assert engine.esamp.distiller == "shared" and engine.bank.shared
    finally:
        engine.close()
