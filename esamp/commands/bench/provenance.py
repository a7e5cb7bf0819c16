"""Where a measurement came from: versions, device, commit. Every results file carries these."""

from __future__ import annotations

import os
import platform
import subprocess


def versions() -> dict:
    """Python, vLLM, torch, transformers and esamp versions (None for what is not installed)."""
    out = {"python": platform.python_version()}
    for name in ("vllm", "torch", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    from esamp import __version__

    out["esamp"] = __version__
    return out


def device() -> str:
    """The GPU's name, or the CPU's description."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def commit() -> str | None:
    """The checkout's commit (``ESAMP_COMMIT`` for a copy of the tree without its .git)."""
    if os.environ.get("ESAMP_COMMIT"):
        return os.environ["ESAMP_COMMIT"]
    try:
        return (
            subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
            or None
        )
    except Exception:
        return None
