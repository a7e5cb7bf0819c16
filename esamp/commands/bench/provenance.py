"""Where a measurement came from: versions, device, commit, and the settings the environment
switched. Every results file carries these."""

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


# Environment variables that choose code paths (ESAMP_UPDATE=inline, ESAMP_STEP=split,
# VLLM_USE_FLASHINFER_SAMPLER=0, ...) are part of what was measured, and not in the command line.
ENV_PREFIXES = ("ESAMP_", "VLLM_")
UNRECORDED = ("KEY", "TOKEN", "SECRET", "PASSWORD")  # (a name holding one of these is never written)


def environment() -> dict[str, str]:
    """The ESAMP_ and VLLM_ environment variables in force, less the commit (``commit`` has it),
    secrets, and paths (machine-specific, and no switch)."""
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if name.startswith(ENV_PREFIXES)
        and name != "ESAMP_COMMIT"
        and not any(word in name for word in UNRECORDED)
        and os.sep not in value
    }


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
