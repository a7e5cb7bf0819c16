"""Drift canaries: fail loudly when a vLLM seam ESamp relies on moves. Run against any vLLM."""

from __future__ import annotations

import inspect

import pytest
from _vllm_helpers import require_vllm

pytestmark = [pytest.mark.vllm]


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require_vllm()


def test_v1_logits_processor_interface():
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    assert {"apply", "is_argmax_invariant", "update_state", "__init__"} <= set(LogitsProcessor.__abstractmethods__)
    assert list(inspect.signature(LogitsProcessor.__init__).parameters) == [
        "self", "vllm_config", "device", "is_pin_memory"]
    assert list(inspect.signature(LogitsProcessor.apply).parameters) == ["self", "logits"]
    assert list(inspect.signature(LogitsProcessor.update_state).parameters) == ["self", "batch_update"]
    assert hasattr(LogitsProcessor, "validate_params")
    assert [f for f in BatchUpdate.__dataclass_fields__] == ["batch_size", "removed", "added", "moved"]
    assert {m.name for m in MoveDirectionality} == {"UNIDIRECTIONAL", "SWAP"}


def test_aux_hidden_state_api_on_llama_and_qwen2():
    from vllm.model_executor.models.llama import LlamaForCausalLM, LlamaModel
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM, Qwen2Model

    for cls in (LlamaForCausalLM, Qwen2ForCausalLM):
        assert hasattr(cls, "set_aux_hidden_state_layers"), cls
        assert "layers" in inspect.signature(cls.set_aux_hidden_state_layers).parameters
    for cls in (LlamaModel, Qwen2Model):
        # the inner model collects hidden + residual *entering* layer k (k = 0: the embeddings)
        src = inspect.getsource(cls.forward)
        assert "_maybe_add_hidden_state" in src and "idx + 1" in src, cls


def test_our_classes_register_and_subclass_the_right_bases():
    from vllm import ModelRegistry

    from esamp.engines.vllm import plugin
    from esamp.engines.vllm.model import EsampLlamaForCausalLM, EsampQwen2ForCausalLM
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    plugin.register()
    archs = set(ModelRegistry.get_supported_archs())
    assert {"EsampLlamaForCausalLM", "EsampQwen2ForCausalLM"} <= archs
    assert issubclass(EsampLlamaForCausalLM, LlamaForCausalLM)
    assert issubclass(EsampQwen2ForCausalLM, Qwen2ForCausalLM)


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("esamp") == "esamp.engines.vllm.plugin:register"


def test_model_runner_in_use_is_v1():
    """Our processor speaks the V1 interface: the V1 model runner must be the one selected."""
    import os

    assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") in ("0", "")
    from vllm.v1.worker import gpu_model_runner

    assert hasattr(gpu_model_runner, "GPUModelRunner")
    src = inspect.getsource(gpu_model_runner.GPUModelRunner)
    assert "compute_logits" in src and "logits_indices" in src


def test_samplers_top_k_top_p_function_is_there():
    """Rows with top-k are filtered with the function vLLM's sampler runs; a move must not go unseen."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from esamp.engines.vllm import steering

    assert list(inspect.signature(apply_top_k_top_p).parameters)[:3] == ["logits", "k", "p"]
    assert steering.vllm_top_k_top_p is apply_top_k_top_p
