"""The dashboard in a real pseudo-terminal: q, ctrl+c, signals and a closed terminal leave no
process behind and the terminal as it was.

A closed terminal is a hung-up tty: the kernel sends its session's leader SIGHUP and SIGCONT at
once, and every write to it then fails. The tests close the master the way a terminal window
does (``Terminal.hang_up``), and also send each half of that alone: a SIGCONT with no stop
before it, and a terminal that goes away with no signal at all (``esamp_tui/driver.py`` says why
both broke the quit).
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import shutil
import signal
import struct
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

import pytest

FAKE_APP = Path(__file__).with_name("fake_app.py")


def children_of(pid: int) -> set[int]:
    """Every live descendant of ``pid``."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parents[int(entry)] = int(fields[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.add(pid)
        except FileNotFoundError:
            pass
    return out


SHELL_LINE = '"$0" "$@"; echo "[dashboard exit $?]"; sleep 30'


class Terminal:
    """The fake dashboard on a 120×40 pty, its output drained so it never blocks.

    ``shell``: started from a shell, as a user starts it, so that what other processes print
    after the dashboard has exited (multiprocessing's resource tracker, say) still reaches the
    terminal; the shell prints ``[dashboard exit N]`` when it returns. ``shell_line``: started by
    that shell line instead (``"$0" "$@"`` is the dashboard).
    """

    def __init__(
        self, *args: str, env: dict[str, str] | None = None, shell: bool = False, shell_line: str | None = None
    ) -> None:
        # the dashboard's cache and configuration (keymap, themes): a folder of its own, not the user's
        self.home = tempfile.mkdtemp(prefix="esamp-test-terminal-")
        pid, fd = pty.fork()
        if pid == 0:  # child: becomes the session leader with the pty as its terminal
            os.environ["TERM"] = "xterm-256color"
            os.environ["ESAMP_CACHE_DIR"] = os.path.join(self.home, "cache")
            os.environ["XDG_CONFIG_HOME"] = os.path.join(self.home, "config")
            os.environ.update(env or {})
            # as a terminal starts it: SIGHUP at its default even when the tests run under nohup
            signal.signal(signal.SIGHUP, signal.SIG_DFL)
            command = [sys.executable, str(FAKE_APP), *args]
            if shell or shell_line:
                command = ["/bin/sh", "-c", shell_line or SHELL_LINE, *command]
            os.execv(command[0], command)
        # pty.fork's master is inheritable: a process this one starts meanwhile would hold the
        # terminal open, and closing it here would then hang nothing up
        os.set_inheritable(fd, False)
        self.pid, self.fd = pid, fd
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.modes_before = termios.tcgetattr(fd)[3]  # local modes: echo, canonical input
        self.output = bytearray()
        self._closing = threading.Event()
        self._closed = False
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self) -> None:
        """Read the dashboard's output until it ends or ``_close`` asks; never reads a closed fd
        (its number may belong to another file of this process by then)."""
        while not self._closing.is_set():
            if not select.select([self.fd], [], [], 0.05)[0]:
                continue
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # EIO: every process of the terminal has let go of it
                return
            if not data:
                return
            self.output += data

    def _close(self) -> None:
        """Close the master once, with no read of it in flight: the terminal is gone when this returns."""
        self._closing.set()
        self.reader.join()
        if not self._closed:
            self._closed = True
            os.close(self.fd)

    def hang_up(self) -> None:
        """The terminal window goes away: the kernel hangs the tty up, sending its session's
        leader SIGHUP and SIGCONT, and the tty refuses every write from then on."""
        self._close()

    def wait_for_worker(self, timeout: float = 30.0) -> set[int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            kids = children_of(self.pid)
            for kid in kids:
                try:
                    cmd = open(f"/proc/{kid}/cmdline", "rb").read()
                except FileNotFoundError:
                    continue
                if b"spawn_main" in cmd:
                    return kids
            time.sleep(0.1)
        raise AssertionError("the worker process did not start")

    def output_text_bytes(self) -> bytes:
        return bytes(self.output)

    def wait_output(self, text: bytes, timeout: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout
        while text not in self.output and time.monotonic() < deadline:
            time.sleep(0.05)
        return text in self.output

    def send(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def exit_status(self, timeout: float = 15.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return status
            time.sleep(0.05)
        return None

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        self._close()
        shutil.rmtree(self.home, ignore_errors=True)


def assert_all_gone(pids: set[int], timeout: float = 8.0) -> None:
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids), f"left behind: {alive(pids)}"


@pytest.mark.parametrize("keys", [b"q", b"\x03", b"\x11"], ids=["q", "ctrl+c", "ctrl+q"])
def test_quit_keys_leave_no_process(keys):
    term = Terminal("stream forever")
    try:
        family = term.wait_for_worker()
        time.sleep(1.0)  # let it stream a little
        term.send(keys)
        status = term.exit_status()
        assert status is not None, "the dashboard did not quit"
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        time.sleep(0.3)  # the last output drained
        assert_terminal_restored(term)  # and no "leaked semaphore" warning printed over it
        assert_all_gone(family)
    finally:
        term.kill()


@pytest.mark.parametrize(
    "prompt, env",
    [("stream forever", {}), (None, {"ESAMP_TEST_LOAD_SECONDS": "60"})],
    ids=["streaming", "loading"],
)
def test_closed_terminal_leaves_no_process(prompt, env):
    """The terminal window closes while the dashboard streams, or while its worker still loads:
    the dashboard quits as on SIGHUP (exit status 129) and takes its worker and the resource
    tracker with it."""
    term = Terminal(*([prompt] if prompt else []), env=env)
    try:
        family = term.wait_for_worker()
        time.sleep(1.0)
        family = children_of(term.pid)  # everything it has started by now
        term.hang_up()
        status = term.exit_status()
        assert status is not None, "the dashboard did not quit"
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGHUP
        assert_all_gone(family)
    finally:
        term.kill()


def test_sigcont_without_a_stop_leaves_the_dashboard_as_it_is():
    """SIGCONT with no SIGTSTP before it (a closed terminal sends one with its SIGHUP, and
    ``kill -CONT`` anyone): Textual 8 took it for the return from ctrl+z and started the
    terminal's modes and its input and output threads a second time beside the running ones."""
    term = Terminal("stream forever")
    try:
        family = term.wait_for_worker()
        time.sleep(1.0)
        mark = len(term.output)
        os.kill(term.pid, signal.SIGCONT)
        time.sleep(1.0)
        assert ALT_SCREEN_ON not in term.output[mark:], "application mode started again"
        term.send(b"q")
        status = term.exit_status()
        assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        time.sleep(0.3)  # the last output drained
        assert_terminal_restored(term)
        assert_all_gone(family)
    finally:
        term.kill()


def test_a_stop_and_continue_redraws_and_still_quits():
    """SIGTSTP (ctrl+z) then SIGCONT (fg): the dashboard gives the terminal back while stopped,
    takes it again when continued, and quits as before."""
    term = Terminal("stream forever")
    try:
        family = term.wait_for_worker()
        time.sleep(1.0)
        os.kill(term.pid, signal.SIGTSTP)
        assert wait_state(term.pid, "T"), "the dashboard did not stop"
        mark = len(term.output)
        os.kill(term.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while ALT_SCREEN_ON not in term.output[mark:] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ALT_SCREEN_ON in term.output[mark:], "the dashboard did not take the terminal back"
        term.send(b"q")
        status = term.exit_status()
        assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        time.sleep(0.3)
        assert_terminal_restored(term)
        assert_all_gone(family)
    finally:
        term.kill()


def test_a_terminal_gone_without_a_hangup_signal_still_ends_the_dashboard():
    """The terminal goes away but no SIGHUP reaches the dashboard (its session's leader, here a
    shell, ignores it and passes nothing on): the first write the terminal refuses ends it as
    SIGHUP would. Textual's output thread used to die on that write; with nothing draining its
    queue, the dashboard's next 30 writes blocked it for good."""
    term = Terminal("stream forever", shell_line='trap "" HUP; "$0" "$@"; exit $?')
    try:
        family = term.wait_for_worker()
        time.sleep(1.0)
        family = children_of(term.pid)  # the dashboard, its worker, the resource tracker
        term.hang_up()
        status = term.exit_status()  # the shell returns the dashboard's status
        assert status is not None, f"the dashboard did not quit: {alive(family)} left"
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGHUP
        assert_all_gone(family)
    finally:
        term.kill()


def wait_state(pid: int, state: str, timeout: float = 10.0) -> bool:
    """Wait until ``pid``'s state in /proc is ``state`` ("T": stopped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == state:
                return True
        time.sleep(0.05)
    return False


ALT_SCREEN_ON, ALT_SCREEN_OFF = b"\x1b[?1049h", b"\x1b[?1049l"
MOUSE_OFF = b"\x1b[?1000l"


def assert_terminal_restored(term: Terminal) -> None:
    out = term.output_text_bytes()
    assert ALT_SCREEN_ON in out, "the dashboard never drew"
    tail = out[out.rindex(ALT_SCREEN_ON) :]
    assert ALT_SCREEN_OFF in tail and MOUSE_OFF in tail, "alternate screen or mouse reporting left on"
    assert termios.tcgetattr(term.fd)[3] & (termios.ECHO | termios.ICANON) == term.modes_before & (
        termios.ECHO | termios.ICANON
    ), "echo/line mode not restored"
    assert b"leaked semaphore" not in out and b"Traceback" not in out


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_signals_quit_like_q(how):
    term = Terminal("stream forever")
    try:
        family = term.wait_for_worker()
        time.sleep(1.5)  # streaming
        os.kill(term.pid, how)
        status = term.exit_status()
        assert status is not None, "the dashboard did not quit"
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + how
        time.sleep(0.3)  # the last output drained
        assert_terminal_restored(term)
        assert_all_gone(family)
    finally:
        term.kill()


def test_sigterm_during_a_cold_start_leaves_no_orphan():
    """SIGTERM while the worker is still loading its model: the dashboard goes, and the worker
    with it (it does not first finish loading)."""
    term = Terminal(env={"ESAMP_TEST_LOAD_SECONDS": "60"})
    try:
        family = term.wait_for_worker()
        time.sleep(2.0)  # the worker is spinning in its "load"
        os.kill(term.pid, signal.SIGTERM)
        assert term.exit_status() is not None, "the dashboard did not quit"
        assert_all_gone(family, timeout=6.0)
        assert_terminal_restored(term)
    finally:
        term.kill()


def test_quit_leaves_nothing_on_the_users_terminal():
    """q after a first start whose model conversion made a named semaphore (tqdm's lock): the
    shell gets the terminal back with nothing printed after the dashboard, no "leaked semaphore
    objects" from multiprocessing's resource tracker, which outlives the dashboard by a moment."""
    term = Terminal("stream", env={"ESAMP_TEST_NAMED_LOCK": "1"}, shell=True)
    try:
        family = term.wait_for_worker()
        time.sleep(1.0)
        term.send(b"q")
        assert term.wait_output(b"[dashboard exit 0]"), "the dashboard did not quit"
        assert_all_gone(family)  # the resource tracker included: it ends once both have exited
        time.sleep(0.5)
        out = term.output_text_bytes()
        after = out[out.rindex(ALT_SCREEN_OFF) + len(ALT_SCREEN_OFF) :]
        printed = re.sub(rb"\x1b\[[?<>=]?[0-9;]*[A-Za-z]", b"", after).replace(b"[dashboard exit 0]", b"")
        assert not printed.strip(), printed  # after the terminal's modes are restored: nothing
        assert b"leaked" not in out and b"Traceback" not in out and b"Warning" not in out
    finally:
        term.kill()
