"""``esamp-tui`` on the scripted engine, for the terminal tests: ``python fake_app.py [prompt]``.

``ESAMP_TEST_LOAD_SECONDS`` makes the engine spin that long before it is ready (a cold start);
``ESAMP_TEST_NAMED_LOCK=1`` makes it create a named semaphore, as a model conversion's progress
bar does.
"""

import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

if __name__ == "__main__":
    from esamp_tui.__main__ import run_app
    from tui.conftest import FixedMemory, fake_options

    prompt = sys.argv[1] if len(sys.argv) > 1 else None
    load = float(os.environ.get("ESAMP_TEST_LOAD_SECONDS", "0"))
    named_lock = os.environ.get("ESAMP_TEST_NAMED_LOCK") == "1"
    options = fake_options(
        prompt=prompt, max_tokens=30000, engine_options=dict(delay=0.05, load_seconds=load, named_lock=named_lock)
    )
    sys.exit(run_app(options, memory_sampler=FixedMemory()))
