"""A served engine's workers stop when their engine core stops them, not halfway through a step.

When a server is stopped as a whole (Ctrl-C in its terminal, ``kill -- -PGID``, a service
manager's SIGTERM to every process of the service), the signal reaches vLLM's worker processes at
the same moment as the API server and the engine core. vLLM 0.30's worker exits at once on it
(``WorkerProc.worker_main`` raises ``SystemExit``), in the middle of whatever step the engine core
is waiting for: the engine core then fails that step ("EngineCore encountered a fatal error", a
traceback), the API server's output handler fails after it (another), and every open request ends
with vLLM's 500 "EngineCore encountered an issue" instead of the server's own answer.

Under ``esamp serve`` the API server ends every open request the moment the signal comes (the
middleware, docs/serving.md "Stopping the server"), the engine core then has no work and shuts
down, and it stops its workers itself (closing their death pipe, vLLM's own path), all within a
step or two. So a served worker puts off the first SIGTERM or SIGINT by ``DEFER_SECONDS`` and
leaves the exit to its engine core meanwhile; when that time is up (and it has not been stopped),
or on a second signal (Ctrl-C pressed again), it exits as vLLM's worker does. It never ignores
one: vLLM's own clean-ups stop a worker with a single SIGTERM and wait for it (an engine core that
fails to start terminates and joins its workers at exit). Only vLLM's multiprocess worker's
handler is replaced, and only in a served engine (``esamp.serving.plugin`` calls
``worker_waits_for_engine_core`` on each of its workers): an engine core that runs its worker in
its own process keeps its handlers.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

log = logging.getLogger(__name__)

VLLM_WORKER_HANDLER = "WorkerProc.worker_main.<locals>.signal_handler"  # vLLM 0.30's, by its qualified name
SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEFER_SECONDS = 3.0  # how long a served worker puts off a stop signal: a few engine steps and a teardown


def worker_waits_for_engine_core() -> bool:
    """In a vLLM worker process, put off the first stop signal by ``DEFER_SECONDS`` (see the module
    docstring); True when this process's handlers were vLLM's worker handlers and now are ours."""
    if threading.current_thread() is not threading.main_thread():
        return False
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    if any(getattr(handler, "__qualname__", "") != VLLM_WORKER_HANDLER for handler in previous.values()):
        return False
    passed: list[int] = []

    def handler(signum, frame):
        if passed:  # asked again, or the time is up: exit as vLLM's worker does
            previous[signum](signum, frame)
            return
        passed.append(signum)
        log.info(
            "[esamp] worker: %s received; this worker exits when its engine core stops it, or in %.0f s "
            "(send it again to exit now)",
            signal.Signals(signum).name,
            DEFER_SECONDS,
        )
        later = threading.Timer(DEFER_SECONDS, os.kill, (os.getpid(), signum))
        later.daemon = True  # a worker that exits meanwhile is not kept waiting for it
        later.start()

    for sig in SIGNALS:
        signal.signal(sig, handler)
    return True
