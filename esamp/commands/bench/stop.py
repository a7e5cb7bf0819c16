"""How ``esamp bench`` stops on SIGINT or SIGTERM and still writes its report.

On a GPU the bench runs under a time limit, ``timeout -s INT 560 python3 -m esamp bench ...``.
GNU timeout sends its signal to the bench and then to the bench's whole process group, so the
bench can receive it twice, back to back, and vLLM's engine processes, in that group, stop on it
too. With Python's own handler each copy raises KeyboardInterrupt: the second one lands wherever
the first one's handling has got to (a few runs in a hundred on a two-core machine, more with
more processes in the group). The bench used to summarise a cut workload inside its
``except KeyboardInterrupt``, so the copy dropped that workload (a first workload cut: an empty
table, as a TP = 2 run showed) or, landing a little later, the whole report.

And an interrupt does not always come out as KeyboardInterrupt: one that lands inside a lock's
wait (vLLM's client waits on a queue for the engine's outputs) can come out as
``RuntimeError: release unlocked lock``, and an engine process that the same signal ended makes
the next call to it fail.

``StopSignals`` takes SIGINT and SIGTERM while the bench measures: the first raises
KeyboardInterrupt where the bench is (as Ctrl-C always did) and is remembered, so any exception
that surfaces after it reads as the interruption too; copies within ``GRACE_SECONDS`` of it are
absorbed; a later signal, a person's second Ctrl-C, raises again (the bench leaves at once).
Once the report is being written (``hold``) the first signal is remembered and raises nothing.
"""

from __future__ import annotations

import signal
import threading
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_SECONDS = 1.0  # a second signal this soon after the first is its copy (timeout sends two)


class StopSignals:
    """SIGINT and SIGTERM while the bench runs (see the module docstring). ``install`` and
    ``restore`` work from the main thread only (Python's rule for signal handlers); elsewhere they
    do nothing, and a KeyboardInterrupt still reads as SIGINT (``stopped``)."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first stop signal received
        self.at = 0.0  # when it came (time.monotonic)
        self.holding = False
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers found at ``install``."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.at = signum, now
            if not self.holding:
                raise KeyboardInterrupt
        elif now - self.at > GRACE_SECONDS:
            raise KeyboardInterrupt  # asked again: leave at once

    def hold(self) -> None:
        """From now on a first stop signal is remembered, not raised: the report is being written."""
        self.holding = True

    def stopped(self, exc: BaseException | None = None) -> bool:
        """Whether the bench was stopped: a stop signal came, or ``exc`` is a KeyboardInterrupt
        that came some other way (then taken as SIGINT)."""
        if self.signum is None and isinstance(exc, KeyboardInterrupt):
            self.signum, self.at = signal.SIGINT, time.monotonic()
        return self.signum is not None

    def leave_at_once(self) -> None:
        """A further stop signal ends the process at once (the report is written; the engines close).
        Not before ``GRACE_SECONDS`` have passed since the first one: timeout's copy of it, sent to
        the process group right after, can come tens of milliseconds later on a busy machine, and a
        scripted bench writes its report sooner; let in at once, it ended the bench by the signal
        after the report (CI: ``test_a_bench_cut_by_timeout_writes_every_workload``, timeout then
        exiting by SIGINT instead of with the bench's 130). Until then the handler absorbs it."""
        if self._previous:
            left = GRACE_SECONDS - (time.monotonic() - self.at)
            if left > 0:
                time.sleep(left)  # (a signal meanwhile runs the handler; the sleep then goes on)
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_DFL)

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    @property
    def status(self) -> int:
        """The exit status: 0, or 128 + the signal (130 for SIGINT, 143 for SIGTERM), as a shell
        reports a process that a signal ended."""
        return 0 if self.signum is None else 128 + int(self.signum)
