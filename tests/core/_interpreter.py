"""Running kernel checks in Triton's interpreter, on the CPU, in a process of their own."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


def in_tritons_interpreter(code: str, timeout: float) -> subprocess.CompletedProcess:
    """Run ``code`` with TRITON_INTERPRET=1 from the repository's root."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    folder = triton_folder()
    if folder:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )
