"""A served engine's workers and a stop signal (``esamp.serving.shutdown``): no engine needed."""

from __future__ import annotations

import pytest

WORKER = """
import logging, signal, sys, time
from esamp.serving import shutdown

logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")  # the test reads it

def vllm_handler(signum, frame):  # what vLLM 0.30's worker does on a stop signal
    raise SystemExit(7)

vllm_handler.__qualname__ = shutdown.VLLM_WORKER_HANDLER
for sig in shutdown.SIGNALS:
    signal.signal(sig, vllm_handler)
shutdown.DEFER_SECONDS = 1.0
assert shutdown.worker_waits_for_engine_core()
print("ready", flush=True)
while True:
    time.sleep(0.02)
"""


@pytest.mark.parametrize("signals", [1, 2])
def test_a_served_worker_puts_off_one_stop_signal_and_never_ignores_it(signals):
    """A served engine's worker outlives a stop signal to the whole server long enough for its engine
    core to stop it (esamp.serving.shutdown), then exits as vLLM's worker does; a second signal
    ends it at once. vLLM's own clean-ups send one SIGTERM and wait, so one is never ignored."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", WORKER],
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        child.send_signal(signal.SIGTERM)
        # the first one put off before the second is sent: two sent before the worker ran its
        # handler would reach it as one (signals of a kind do not queue)
        assert "SIGTERM received" in child.stdout.readline()
        if signals == 2:
            child.send_signal(signal.SIGTERM)
        else:
            time.sleep(0.4)
            assert child.poll() is None  # still there, for its engine core to stop it
        assert child.wait(10) == 7  # vLLM's handler ended it
        took = time.monotonic() - t0
        assert (0.9 < took < 3.0) if signals == 1 else took < 0.9
    finally:
        child.kill()


def test_only_vllms_worker_handler_is_replaced():
    import signal

    from esamp.serving.shutdown import SIGNALS, worker_waits_for_engine_core

    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def engine_core_handler(signum, frame):  # an engine core that runs its worker in its own process
        pass

    try:
        for sig in SIGNALS:
            signal.signal(sig, engine_core_handler)
        assert worker_waits_for_engine_core() is False
        assert all(signal.getsignal(sig) is engine_core_handler for sig in SIGNALS)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
