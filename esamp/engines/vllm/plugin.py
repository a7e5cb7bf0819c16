"""The ``vllm.general_plugins`` entry point: register the ESamp model classes with vLLM.

vLLM loads general plugins in every process before it builds the model, so an engine core
spawned in a fresh process finds the classes too. Registration is by lazy ``module:Class``
string, so this import stays cheap and never imports the model code until vLLM needs it.
"""

from __future__ import annotations

from esamp.engines.vllm.settings import ARCHITECTURES

MODEL_MODULE = "esamp.engines.vllm.model"


def register() -> None:
    """Register every ESamp architecture with vLLM's ``ModelRegistry`` (idempotent)."""
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    for esamp_arch in ARCHITECTURES.values():
        if esamp_arch not in known:
            ModelRegistry.register_model(esamp_arch, f"{MODEL_MODULE}:{esamp_arch}")
