"""Running kernel checks in Triton's interpreter, on the CPU, in a process of their own.

A check is single-threaded Python that takes up to about half a minute. A test module names its
checks in ``INTERPRETER_RUNS`` ({test name: code}); the run starts every selected one in the
background once the tests are collected (``start_early``, called by tests/conftest.py), where it
uses the core the suite's own single-threaded tests leave idle, and the test takes its result
(``in_tritons_interpreter``). Run alone, a test starts its check itself."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = "INTERPRETER_RUNS"  # a test module's {test name: code}
_started: dict[str, subprocess.Popen] = {}  # code → its process, started early


def triton_folder() -> str | None:
    """Where Triton is for the interpreter: None when it is installed, else the folder
    ``scripts/setup.sh --dev`` puts it in beside the environment (vLLM for the CPU must not see
    it); skips the test without either."""
    if importlib.util.find_spec("triton") is not None:
        return None
    folder = Path(sys.prefix) / "triton-interpreter"
    if not (folder / "triton").is_dir():
        pytest.skip("Triton is not installed (scripts/setup.sh --dev puts it in .venv/triton-interpreter)")
    return str(folder)


def _start(code: str, folder: str | None) -> subprocess.Popen:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    if folder:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def start_early(code: str) -> None:
    """Start ``code`` in the interpreter now, in the background (nothing where Triton is missing:
    the test then skips)."""
    if code in _started:
        return
    try:
        folder = triton_folder()
    except pytest.skip.Exception:
        return
    _started[code] = _start(code, folder)


def stop_early_runs() -> None:
    """End the checks started early that no test took (a run cut short, a test deselected late)."""
    for proc in _started.values():
        proc.kill()
        proc.wait()
    _started.clear()


def in_tritons_interpreter(code: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``code`` with TRITON_INTERPRET=1 from the repository's root (or take the result of the
    run started early), waiting at most ``timeout`` seconds from now."""
    folder = triton_folder()
    proc = _started.pop(code, None) or _start(code, folder)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
