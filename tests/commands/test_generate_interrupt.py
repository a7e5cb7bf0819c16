"""Ctrl-C during ``esamp generate`` finishes the output, then exits 130 (a real process, SIGINT)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LONG = ["Write a long story about a lighthouse keeper.", "-n", "2", "--max-tokens", "1500", "--threads", "1"]


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    """The rest of stdout and stderr once the process has ended, read through the pipes' own file
    objects. ``communicate()`` reads the raw descriptors, so it would miss what ``readline()`` had
    already buffered: whole events, or a line's tail (its newline alone when the child writes
    unbuffered, as under PYTHONUNBUFFERED), which is how this test once failed at random."""
    with ThreadPoolExecutor(2) as pool:  # both at once: a full stderr pipe must not stall stdout
        out, err = pool.submit(proc.stdout.read), pool.submit(proc.stderr.read)
        try:
            proc.wait(timeout)
        finally:
            proc.kill()  # after a timeout, this ends the reads too
        return out.result(), err.result()


def _start(*extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "esamp", "generate", *LONG, *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_json_mode_ends_every_sample_with_an_abort_done():
    proc = _start("--json")
    try:
        lines = []
        while sum('"type":"token"' in line for line in lines) < 4:  # decoding has begun
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            lines.append(line)
        proc.send_signal(signal.SIGINT)
        out, err = _finish(proc)
    finally:
        proc.kill()
    # JSON lines end at "\n" only: a token's text may hold U+2028 or U+0085, which the JSON keeps
    # as they are and str.splitlines() would take for line ends
    *rest, tail = out.split("\n")
    assert tail == "", f"the output ends inside a line: {tail!r}"
    events = [json.loads(line) for line in lines + rest]  # every line is whole JSON
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    done = [e for e in events if e["type"] == "done"]
    assert sorted(e["sample"] for e in done) == [0, 1]
    assert {e["finish_reason"] for e in done} == {"abort"}
    for e in done:  # each done counts the tokens that sample emitted, none left pending
        emitted = sum(1 for t in events if t["type"] == "token" and t["sample"] == e["sample"])
        assert e["tokens"] == emitted > 0
    assert events[-1]["type"] == "done"


@pytest.mark.slow
def test_text_mode_prints_the_partial_samples_and_the_summary():
    proc = _start()
    try:
        while "engine," not in proc.stderr.readline():  # "reference engine, ... (loaded in ...)"
            assert proc.poll() is None
        time.sleep(2.0)
        proc.send_signal(signal.SIGINT)
        out, err = _finish(proc)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    counts = re.findall(r"── sample \d/2 \(abort, (\d+) tokens\) ──", out)
    assert len(counts) == 2 and sum(map(int, counts)) > 0, out
    summary = out.strip().splitlines()[-1]
    assert "tok/s" in summary and "port hits" in summary and summary.endswith("interrupted")
