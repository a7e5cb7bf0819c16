"""The dashboard's terminal driver: Textual's Linux driver, safe when the terminal goes away.

Closing a terminal hangs up its tty: the kernel sends the session's leader (the dashboard, when
the terminal started it) SIGHUP *and* SIGCONT, and from then on every write to the tty fails
with EIO and every read returns nothing. Textual 8's ``LinuxDriver`` takes that SIGCONT for the
return from a ctrl+z and starts application mode a second time on the dead tty: a second output
thread, which dies on its first write, and a second input thread. The output queue of a dead
thread holds 30 writes; the frames and the shutdown's own writes (terminal modes, mouse, the
queue's end) then block the app's event loop for good once it is full, and the dashboard stays
alive with its resource tracker behind it (tests/tui/test_terminal.py; at random, depending on
how many frames fell between the hang-up and the quit; see
docs/development.md, "Tests that failed once, and why").

``TerminalDriver`` changes two things:

- it resumes on SIGCONT only after its own SIGTSTP stopped it (ctrl+z, then ``fg``), and only
  while the terminal is still there; any other SIGCONT (the hang-up's, or ``kill -CONT``) leaves
  the running app as it is;
- its output thread writes through ``TerminalOutput``: the first write or flush the terminal
  refuses ends the dashboard as SIGHUP does (exit status 129) and every later write is dropped,
  so nothing the app writes can block on a terminal that is gone, and the dashboard ends even
  where no SIGHUP reaches it (a session leader that ignores it).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import termios
from collections.abc import Callable
from typing import IO

from textual.drivers.linux_driver import LinuxDriver

HANGUP_RETURN_CODE = 128 + signal.SIGHUP


class TerminalOutput:
    """The terminal's stream for Textual's output thread; drops everything once a write fails.

    ``on_lost`` is called once, from the output thread, at the first failure."""

    def __init__(self, stream: IO[str], on_lost: Callable[[], None]) -> None:
        self.stream = stream
        self.on_lost = on_lost
        self.lost = False

    def _failed(self) -> None:
        if not self.lost:
            self.lost = True
            self.on_lost()

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self.stream.write(text)
            except (OSError, ValueError):  # EIO on a hung-up tty; ValueError: the stream was closed
                self._failed()
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self._failed()

    def fileno(self) -> int:
        return self.stream.fileno()


class TerminalDriver(LinuxDriver):
    """Textual's Linux driver for a terminal that may go away (see the module's docstring)."""

    def __init__(self, app, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self._file = TerminalOutput(sys.__stderr__, self._terminal_lost)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped_by_tstp = False

    def start_application_mode(self) -> None:
        self._loop = asyncio.get_running_loop()
        super().start_application_mode()

    def _terminal_lost(self) -> None:
        """The terminal refused a write (the output thread calls this): quit as on SIGHUP."""
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._app.exit, None, HANGUP_RETURN_CODE)
        except RuntimeError:  # the loop has closed: the app has already ended
            pass

    def terminal_present(self) -> bool:
        """Whether the terminal is still there: a hung-up tty refuses even to report its modes."""
        if not self.input_tty:
            return True
        try:
            termios.tcgetattr(self.fileno)
        except termios.error:
            return False
        return True

    def _sigtstp_application(self, *args) -> None:
        # Textual suspends application mode before it stops, and means to resume it, only when
        # it restarts on its own; a SIGCONT resumes only that.
        self._stopped_by_tstp = self._auto_restart
        super()._sigtstp_application(*args)

    def _sigcont_application(self, *args) -> None:
        stopped, self._stopped_by_tstp = self._stopped_by_tstp, False
        if stopped and self.terminal_present():
            super()._sigcont_application(*args)
