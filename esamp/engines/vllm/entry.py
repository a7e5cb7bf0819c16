"""``EsampLogitsProcessor``: the class vLLM's logits-processor loaders build for ESamp.

vLLM has two loaders for the same entry-point group (``vllm.logits_processors``) and the same
``--logits-processors`` names: the V1 runner's (``vllm.v1.sample.logits_processor``), which builds
``cls(vllm_config, device, is_pin_memory)``, and, from vLLM 0.31, Model Runner V2's
(``vllm.v1.worker.gpu.sample.logits_processor.loader``), which accepts only subclasses of its own
``LogitsProcessor`` (a V1 class is a ``ValueError`` there) and builds ``cls(vllm_config,
req_states)``. This class subclasses every interface the installed vLLM has, so both loaders
accept it, and builds the adapter of the runner that called it, known by what the runner passed:
the V1 adapter (``v1.V1Adapter``) or the MRV2 one (``mrv2.Mrv2Adapter``). Which runner that is,
vLLM decides (``VllmConfig.use_v2_model_runner``); nothing here reads a version.

``validate_params`` runs in vLLM's frontend, on the class, for either runner.
"""

from __future__ import annotations

from esamp.engines.vllm import settings as es


def _interfaces() -> tuple[type, ...]:
    bases = []
    try:
        from vllm.v1.sample.logits_processor import LogitsProcessor as V1

        bases.append(V1)
    except ImportError:  # pragma: no cover - a vLLM without the V1 runner
        pass
    try:
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2

        bases.append(V2)
    except ImportError:  # vLLM ≤ 0.30: Model Runner V2 takes no custom processor
        pass
    if not bases:  # pragma: no cover
        raise ImportError("this vLLM has no logits-processor interface ESamp knows (docs/vllm.md)")
    return tuple(bases)


def runner_of(args: tuple) -> str:
    """ "mrv2" when a loader built us with MRV2's arguments (``req_states``), else "v1"."""
    try:
        from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState
    except ImportError:  # pragma: no cover
        return "v1"
    return "mrv2" if len(args) == 1 and isinstance(args[0], LogitsProcRequestState) else "v1"


class EsampLogitsProcessor(*_interfaces()):
    """Builds ESamp's adapter for the runner that asks (see the module docstring)."""

    def __new__(cls, vllm_config, *args, **kwargs):
        if runner_of(args) == "mrv2":
            from esamp.engines.vllm.mrv2 import Mrv2Adapter as adapter
        else:
            from esamp.engines.vllm.v1 import V1Adapter as adapter
        return adapter(vllm_config, *args, **kwargs)  # not an instance of cls: __init__ is not run again

    @classmethod
    def validate_params(cls, params) -> None:
        """vLLM's check of each request, in its frontend: ``settings.prepare``, which also changes
        ``params`` for a request ESamp steers: its group, and its filters handed to ESamp
        (``settings.hand_filters_to_esamp``: vLLM keeps neutral ones)."""
        es.prepare(params)
