"""Drift canaries: fail loudly when a vLLM seam ESamp relies on moves. Run against any vLLM."""

from __future__ import annotations

import inspect

import pytest
import torch

from _vllm_helpers import HAS_MRV2_PROCESSORS, require_vllm

pytestmark = [pytest.mark.vllm]


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require_vllm()


def test_v1_logits_processor_interface():
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    assert {"apply", "is_argmax_invariant", "update_state", "__init__"} <= set(LogitsProcessor.__abstractmethods__)
    assert list(inspect.signature(LogitsProcessor.__init__).parameters) == [
        "self",
        "vllm_config",
        "device",
        "is_pin_memory",
    ]
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
    from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    from esamp.engines.vllm import plugin, settings as es
    from esamp.engines.vllm.model import EsampGemma3ForCausalLM, EsampLlamaForCausalLM, EsampQwen2ForCausalLM

    plugin.register()
    archs = set(ModelRegistry.get_supported_archs())
    assert set(es.ARCHITECTURES.values()) <= archs
    assert set(es.ARCHITECTURES) <= archs  # every base is one vLLM knows
    assert issubclass(EsampLlamaForCausalLM, LlamaForCausalLM)
    assert issubclass(EsampQwen2ForCausalLM, Qwen2ForCausalLM)
    assert issubclass(EsampGemma3ForCausalLM, Gemma3ForCausalLM)


def test_gemma3_parts_and_layer_loop_the_gemma3_tap_rebuilds():
    """``EsampGemma3ForCausalLM`` builds the parts vLLM's Gemma3ForCausalLM builds (with its own
    inner model) and runs the inner model's layer loop with taps. Both follow vLLM's: the same
    attributes, a loop that hands each layer (hidden, residual) and adds them in the next layer's
    input norm (so their sum is the stream between two layers), the final norm on both."""
    import re

    from vllm.model_executor.models.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3Model

    init = inspect.getsource(Gemma3ForCausalLM.__init__)
    assert set(re.findall(r"self\.(\w+) =", init)) == {
        "config",
        "quant_config",
        "model",
        "lm_head",
        "logits_processor",
        "make_empty_intermediate_tensors",
    }
    assert "tie_weights(self.model.embed_tokens)" in init and "soft_cap=config.final_logit_softcapping" in init
    assert not hasattr(Gemma3ForCausalLM, "set_aux_hidden_state_layers")  # else use vLLM's, as for Llama
    forward = inspect.getsource(Gemma3Model.forward)
    assert "hidden_states = self.embed_input_ids(input_ids)" in forward and "residual = None" in forward
    assert "hidden_states, residual = layer(" in forward and "self.norm(hidden_states, residual)" in forward
    assert "* self.normalizer" in inspect.getsource(Gemma3Model.embed_input_ids)
    layer = inspect.getsource(Gemma3DecoderLayer.forward)
    assert "self.input_layernorm(hidden_states, residual)" in layer
    assert layer.rstrip().endswith("return hidden_states, residual")


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("esamp") == "esamp.engines.vllm.plugin:register"


def test_both_runners_gather_logits_rows_then_call_compute_logits():
    """The taps arrive in logits-row order because both runners call the model's compute_logits on
    hidden_states[logits_indices] (V1: gpu_model_runner; MRV2 from 0.31: gpu/model_runner)."""
    from vllm.v1.worker import gpu_model_runner

    src = inspect.getsource(gpu_model_runner.GPUModelRunner)
    assert "compute_logits" in src and "logits_indices" in src
    if HAS_MRV2_PROCESSORS:
        from vllm.v1.worker.gpu import model_runner

        src = inspect.getsource(model_runner)
        assert "hidden_states[input_batch.logits_indices]" in src and "self.model.compute_logits(" in src


def test_runner_choice_reads_triton_the_env_and_which_processors():
    """How vLLM picks its runner: VLLM_USE_V2_MODEL_RUNNER first, then Triton; on vLLM with the
    V2 default but no MRV2 processor interface (0.21-0.30) any visible logits-processor entry
    point sends the engine to V1 (why esamp installs none: esamp/engines/vllm/plugin.py)."""
    from vllm.config import VllmConfig

    if not hasattr(VllmConfig, "use_v2_model_runner"):  # 0.20: MRV2 only on request, refusing
        # custom processors named in the config (installed ones do not count)
        import vllm.config.vllm as module

        src = inspect.getsource(module)
        assert "VLLM_USE_V2_MODEL_RUNNER" in src and "custom logits processors" in src
        assert 'entry_points(group="vllm.logits_processors")' not in src
        return
    chooser = inspect.getsource(VllmConfig.use_v2_model_runner.fget)
    assert "VLLM_USE_V2_MODEL_RUNNER" in chooser and "HAS_TRITON" in chooser
    unsupported = inspect.getsource(VllmConfig._get_v2_model_runner_unsupported_features)
    entry_point_sends_to_v1 = 'entry_points(group="vllm.logits_processors")' in unsupported
    assert entry_point_sends_to_v1 is not HAS_MRV2_PROCESSORS


def test_v1_runner_waits_on_sampled_tokens_only_for_named_processors():
    """The reason ESamp's engines load the processor from an entry point, not by name: the V1
    runner keeps output ids and, under async scheduling, waits for each step's sampled tokens
    for processors named in logits_processors only."""
    from vllm.v1.worker import gpu_model_runner

    src = inspect.getsource(gpu_model_runner.GPUModelRunner.__init__)
    assert "logitsprocs_need_output_token_ids=bool(custom_logitsprocs)" in src


def test_v1_loader_seams():
    from vllm.v1.sample import logits_processor as lp

    assert lp.LOGITSPROCS_GROUP == "vllm.logits_processors"
    assert list(inspect.signature(lp.build_logitsprocs).parameters) == [
        "vllm_config",
        "device",
        "is_pin_memory",
        "is_pooling_model",
        "custom_logitsprocs",
    ]
    assert "ctor(vllm_config, device, is_pin_memory)" in inspect.getsource(lp.build_logitsprocs)
    assert callable(lp._load_logitsprocs_plugins) and callable(lp.validate_logits_processors_parameters)


@pytest.mark.skipif(not HAS_MRV2_PROCESSORS, reason="MRV2 logits-processor interface: vLLM >= 0.31")
def test_mrv2_logits_processor_interface():
    from vllm.v1.worker.gpu.sample.logits_processor import (
        LogitsContext,
        LogitsProcessor,
        LogitsProcRequestState,
        loader,
    )

    assert LogitsProcessor.__abstractmethods__ == {"apply"}
    sig = {
        name: list(inspect.signature(getattr(LogitsProcessor, name)).parameters)
        for name in ("__init__", "validate_params", "add_request", "apply_staged_writes", "apply")
    }
    assert sig == {
        "__init__": ["self", "vllm_config", "req_states"],
        "validate_params": ["sampling_params"],
        "add_request": ["self", "req_idx", "sampling_params"],
        "apply_staged_writes": ["self"],
        "apply": ["self", "logits", "ctx"],
    }
    assert list(LogitsContext.__dataclass_fields__) == [
        "expanded_idx_mapping",
        "idx_mapping",
        "idx_mapping_np",
        "expanded_local_pos",
        "input_ids",
        "pos",
        "seq_lens_upper_bound_np",
    ]
    assert list(LogitsProcRequestState.__dataclass_fields__) == [
        "device",
        "max_num_reqs",
        "vocab_size",
        "all_token_ids",
        "prompt_len",
        "prefill_len",
        "total_len",
    ]
    # the loader: entry points first, MRV2 subclasses only, built with (vllm_config, req_states)
    assert loader.LOGITSPROCS_GROUP == "vllm.logits_processors"
    assert "issubclass(cls, LogitsProcessor)" in inspect.getsource(loader._load_v2_logitsprocs_plugins)
    assert "ctor(vllm_config, lp_req_state)" in inspect.getsource(loader.build_custom_logits_processors)
    # the sampler: custom processors after bias/penalties/bad words, before temperature and the filters
    from vllm.v1.worker.gpu.sample import sampler

    src = inspect.getsource(sampler.Sampler.apply_sampling_params)
    assert src.index("processor.apply(logits, ctx)") < src.index("apply_temperature") < src.index("apply_min_p")
    assert "needs_logits_processing" in src  # a batch where no request needs a processor skips them all


@pytest.mark.skipif(not HAS_MRV2_PROCESSORS, reason="MRV2 logits-processor interface: vLLM >= 0.31")
def test_mrv2_facts_the_mrv2_adapter_relies_on():
    """esamp/engines/vllm/mrv2.py: a resumed request is added again (so a slot's row is always its
    request's); the runner's request state holds prompt lengths on the host (``prompt_len.np``);
    the host sequence lengths are computed tokens + scheduled ones (so minus the prompt length
    they are the generation index); nothing tells processors that a request left its slot."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu import buffer_utils, model_runner

    assert "scheduled_new_reqs.extend(scheduled_resumed_reqs)" in inspect.getsource(Scheduler.schedule)
    assert "self.np = " in inspect.getsource(buffer_utils.UvaBackedTensor.__init__)
    runner = model_runner.GPUModelRunner
    prepare = inspect.getsource(runner.prepare_inputs)
    assert "num_computed_tokens_np[idx_mapping_np]" in prepare and "seq_lens_cpu_upper_bound" in prepare
    assert "self.sampler.add_request(req_index" in inspect.getsource(runner.add_requests)
    assert "sampler" not in inspect.getsource(runner._remove_request)


def test_aux_layers_come_back_in_layer_order_once_each():
    """0.20 stores the layers as given, later versions sorted and de-duplicated; either way the
    inner model appends one state per tapped layer in the layer loop, so ESamp passes them sorted
    and unique and finds each tap by layer id (esamp/engines/vllm/model.py)."""
    from vllm.model_executor.models.interfaces import EagleModelMixin

    mixin = EagleModelMixin()
    mixin._set_aux_hidden_state_layers((2, 5))
    assert tuple(mixin.aux_hidden_state_layers) == (2, 5)
    collected = []
    for layer in range(7):
        mixin._maybe_add_hidden_state(collected, layer, torch.full((1,), float(layer)), None)
    assert [int(t) for t in collected] == [2, 5]


def test_request_arguments_esamp_uses_are_its_own():
    """vllm_xargs reach SamplingParams.extra_args; vLLM reads a few keys of its own there
    (session_id, kv_transfer_params, ...). ESamp's keys all carry its prefix."""
    from esamp.core import payload as pl

    assert pl.PREFIX.startswith("esamp")
    assert not {"session_id", "kv_transfer_params", "ec_transfer_params"} & set(pl.encode(group="g", sample=0, n=1))


def test_validate_params_errors_reach_clients_as_validation_errors():
    """A ValueError from validate_params reaches the client as a 400: as it is on 0.20, as vLLM's
    VLLMValidationError (a client error) from the versions that have it."""
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

    src = inspect.getsource(validate_logits_processors_parameters)
    assert "validate_params(sampling_params)" in src
    if "VLLMValidationError" in src:
        from vllm.exceptions import VLLMValidationError

        assert VLLMValidationError.__mro__[1].__name__ == "VLLMClientError"


def test_samplers_top_k_top_p_function_is_there():
    """Rows with top-k are filtered with the function vLLM's sampler runs; a move must not go unseen."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from esamp.engines.vllm import steering

    assert list(inspect.signature(apply_top_k_top_p).parameters)[:3] == ["logits", "k", "p"]
    assert steering.vllm_top_k_top_p is apply_top_k_top_p
