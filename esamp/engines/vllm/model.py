"""Out-of-tree model classes with graph-safe taps: ``EsampLlamaForCausalLM``, ``EsampQwen2ForCausalLM``,
``EsampGemma3ForCausalLM`` (``settings.ARCHITECTURES`` says which serves which base architecture).

The Llama and Qwen2 taps switch on vLLM's own auxiliary hidden-state outputs (the EAGLE-3 taps,
``set_aux_hidden_state_layers``); vLLM's Gemma 3 has none, so its tap brings an inner model of its
own that collects the same states (``_build_gemma3``). The inner model collects, for each tapped
layer k, ``hidden + residual`` *before* layer k runs (k = 0 is the embeddings): the residual stream
entering layer k, before any norm, in increasing layer order and once per layer. So the input of
``layers[i].input_layernorm`` is the tap of layer i, and applying that module to the tapped rows
gives exactly what the reference engine's forward hook on ``layers[i].input_layernorm`` sees.
(vLLM's fused add+norm adds in the model dtype, so the two agree to bf16 rounding.) Taps are
found by layer id, never by the position vLLM stored them at.

``forward`` returns ``cat([h, aux...], -1)``: tensors only, so the taps survive torch.compile and
CUDA graphs (a forward hook would not fire under graph replay). The runner then gathers one row
per scheduled request, in logits-row order, and calls ``compute_logits`` eagerly. That asks the
engine's ``StepExchange`` for this step's plan; with nothing to steer it runs vLLM's own head on
the first H columns (a view) and does nothing else. Otherwise it hands the tap columns to the
exchange, which runs the Distiller step (the norms inside it) and returns ŷ. vLLM's own head then
makes the logits from h, the product it runs without ESamp, and the Distiller logits d = W·ŷ go back to
the exchange as their two factors (``intervention.HeadProduct``): the fused filter computes d
only at each row's candidates, a few tokens under min-p, where a [rows, V] product would cost
the step a second pass over the head's weights on the tensor cores. Where this worker holds no
dense weight (a quantised head; one vocabulary shard under tensor parallelism), or a steered row's
filters leave every token a candidate (no min-p, no top-k: ``triton_filter.few_candidates``), the
head runs once on ``[h; ŷ]``: the first rows are the logits, the rest are d.
A call with plain H-wide rows (a model built without taps) passes straight through.
"""

from __future__ import annotations

import torch

from esamp.core.distiller import TapNorm, TapNorms
from esamp.core.intervention import HeadProduct
from esamp.engines.vllm.exchange import exchange_for
from esamp.engines.vllm.settings import engine_config


class _TapMixin:
    """Mixed in front of a vLLM causal LM with ``set_aux_hidden_state_layers`` (vLLM's
    ``SupportsEagle3``, or the Gemma 3 base below), whose forward then returns ``(h, [aux...])``."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self.esamp_hidden = int(self.config.hidden_size)
        # Under tensor parallelism the head's weight is one vocabulary shard per worker.
        self.esamp_head_sharded = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1) > 1
        settings = engine_config(vllm_config)
        self.esamp_taps: tuple[int, int] | None = None
        if settings is not None:
            src, tgt = settings.source_layer, settings.target_layer
            L = int(self.config.num_hidden_layers)
            if not (0 <= src < L and 0 <= tgt < L):
                raise ValueError(f"ESamp tap layers ({src}, {tgt}) out of range for {L} layers")
            self.esamp_taps = (src, tgt)
            self.esamp_aux_layers = tuple(sorted({src, tgt}))  # the order vLLM returns them in
            self.set_aux_hidden_state_layers(self.esamp_aux_layers)
            # which H-wide block of the tap columns is the source and which the target
            self.esamp_tap_blocks = (self.esamp_aux_layers.index(src), self.esamp_aux_layers.index(tgt))
        self.esamp_exchange = exchange_for(vllm_config)
        self.esamp_exchange.attach_model(self)

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if isinstance(out, tuple):  # (h, [aux...]) once aux layers are set
            hidden, aux = out
            return torch.cat([hidden, *aux], dim=-1)
        return out

    def compute_logits(self, hidden_states: torch.Tensor):
        H = self.esamp_hidden
        if self.esamp_taps is None or hidden_states.shape[-1] == H:
            return super().compute_logits(hidden_states)
        rows = hidden_states.shape[0]
        hidden = hidden_states[:, :H]  # a view: the LM head reads it in place on a GPU
        if not hidden.is_cuda:
            hidden = hidden.contiguous()  # vLLM's CPU GEMMs want contiguous rows
        exchange = self.esamp_exchange
        plan = exchange.begin(rows)
        src, tgt = self.esamp_tap_blocks
        head_dtype = self.esamp_head_dtype(hidden)
        aux, normalize = hidden_states[:, H:], self.esamp_normalize
        if plan is None:
            # Nothing to steer this step: not a kernel or a copy more than plain vLLM (the first
            # such step, before any request, captures the Distiller's graphs), unless an adapter
            # that learns its rows only later wants this step's taps kept.
            exchange.warm_up(aux, src, tgt, normalize, head_dtype)
            exchange.put_taps_late(aux, src, tgt, normalize, head_dtype)
            return super().compute_logits(hidden)
        prediction = exchange.put_taps(plan, aux, src, tgt, normalize, head_dtype)
        weight = self.esamp_dense_weight() if plan.few_candidates else None
        if weight is not None and self._esamp_plain_head():
            # vLLM's own head on h, and d = W·ŷ left as its factors: the filter computes d only at
            # each row's candidates (a few under min-p) instead of a second [rows, V] product.
            exchange.put_distiller_logits(plan, HeadProduct(prediction, weight))
            return super().compute_logits(hidden)
        if self._esamp_plain_head():
            # No dense weight here (a quantised head, or one vocabulary shard per worker): one GEMM
            # over [h; ŷ] reads the head's weights once for the logits and d = W·ŷ.
            both = super().compute_logits(torch.cat([hidden, prediction]))
            exchange.put_distiller_logits(plan, both[rows:])
            return both[:rows]
        # A head that post-processes its logits (soft cap, scale): d from the dense weight.
        logits = super().compute_logits(hidden)
        head = self.esamp_lm_head()
        exchange.put_distiller_logits(plan, prediction.to(head.dtype) @ head[: logits.shape[-1]].t())
        return logits

    @property
    def esamp_normalize(self):
        """How the Distiller step turns the taps into its x and y: the two input norms as
        ``TapNorms`` (their weights and ε, which the fused kernels fold into their products) where
        both are vLLM's RMSNorm or Gemma's, else the modules themselves (``esamp_tap_norms``)."""
        norms = getattr(self, "_esamp_norms", None)
        if norms is None:
            layers = self.model.layers
            src, tgt = self.esamp_taps
            source, target = tap_norm(layers[src].input_layernorm), tap_norm(layers[tgt].input_layernorm)
            norms = TapNorms(source, target) if source is not None and target is not None else self.esamp_tap_norms
            self._esamp_norms = norms
        return norms

    def esamp_tap_norms(self, source: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two tapped residual rows through their layers' input norms: the Distiller's x and y."""
        layers = self.model.layers
        src, tgt = self.esamp_taps
        return (
            _first(layers[src].input_layernorm(source.contiguous())),
            _first(layers[tgt].input_layernorm(target.contiguous())),
        )

    def esamp_head_dtype(self, hidden: torch.Tensor) -> torch.dtype:
        """The dtype ŷ joins the LM head's input rows in."""
        return hidden.dtype

    def _esamp_plain_head(self) -> bool:
        """True when ``compute_logits`` is exactly W·h (no soft cap, scale 1, hidden states in)."""
        lp = getattr(self, "logits_processor", None)
        return (
            lp is not None
            and getattr(lp, "soft_cap", None) is None
            and float(getattr(lp, "scale", 1.0)) == 1.0
            and not getattr(lp, "logits_as_input", False)
        )

    # -- what the processor needs from the model ----------------------------------------------

    def esamp_dense_weight(self) -> torch.Tensor | None:
        """The LM head's own [V', H] weight when this worker holds all of it unquantised, else None."""
        weight = getattr(self.lm_head, "weight", None)
        if (
            not self.esamp_head_sharded
            and isinstance(weight, torch.Tensor)
            and weight.dim() == 2
            and weight.shape[1] == self.esamp_hidden
            and weight.dtype.is_floating_point
            and weight.dtype.itemsize >= 2
        ):
            return weight
        return None

    def esamp_lm_head(self) -> torch.Tensor:
        """The LM head as a dense [V, H] matrix (vocab padding included, never read past V).

        Unquantised heads on one worker return their weight. A quantised head (GGUF) has no dense
        weight, and a tensor-parallel worker holds one vocabulary shard of it; then the whole head
        is materialised once by running the head (gathered) on the H unit vectors, which gives W^T
        exactly.
        """
        weight = self.esamp_dense_weight()
        if weight is not None:
            return weight
        H = self.esamp_hidden
        cached = getattr(self, "_esamp_dense_head", None)
        if cached is None:
            param = next(self.parameters())
            dtype = param.dtype if param.dtype.is_floating_point else torch.float16
            eye = torch.eye(H, device=param.device, dtype=dtype)
            with torch.inference_mode():
                cols = super().compute_logits(eye)  # [H, V]
            cached = cols.t().contiguous()
            self._esamp_dense_head = cached
        return cached


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def tap_norm(module) -> TapNorm | None:
    """``module`` as a ``TapNorm`` when it is exactly vLLM's ``RMSNorm`` (offset 0) or
    ``GemmaRMSNorm`` (offset 1) over the whole row; None for any other norm (the Distiller step
    then calls the module)."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    kind = type(module)
    if (
        kind not in (RMSNorm, GemmaRMSNorm)
        or getattr(module, "variance_size_override", None) is not None
        or not getattr(module, "has_weight", True)
    ):
        return None
    return TapNorm(module.weight.data, float(module.variance_epsilon), 1.0 if kind is GemmaRMSNorm else 0.0)


def _module_level(cls: type) -> type:
    """Name ``cls`` (built inside a function, so that vLLM is imported only here) as this module's
    attribute of its name, so that pickle finds it by reference: vLLM saves its torch.compile
    artifact with the compiled model's class, and a class named ``_build_gemma3.<locals>...``
    cannot be saved ("unable to save AOT compiled function"), so every start compiled again."""
    cls.__qualname__ = cls.__name__
    for attr in vars(cls).values():
        if callable(attr) and getattr(attr, "__module__", None) == __name__ and hasattr(attr, "__qualname__"):
            attr.__qualname__ = f"{cls.__name__}.{attr.__name__}"
    globals()[cls.__name__] = cls
    return cls


def _build():
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    class EsampLlamaForCausalLM(_TapMixin, LlamaForCausalLM):
        pass

    class EsampQwen2ForCausalLM(_TapMixin, Qwen2ForCausalLM):
        pass

    return EsampLlamaForCausalLM, EsampQwen2ForCausalLM


def _build_gemma3():
    """Gemma 3 with the taps of the classes above.

    vLLM's ``Gemma3Model`` returns only the final normed state. ``_TappedGemma3Model`` is that
    model (its ``__init__``, its weights, its torch.compile wrapper: the decorator on the base class
    compiles the subclass's ``forward``) with a forward that also returns, for each tapped layer k,
    the residual stream entering layer k: ``hidden + residual`` before layer k runs, the scaled
    embeddings (× √H, as vLLM's own) for k = 0. That is the input of ``layers[k].input_layernorm``,
    as for Llama, and what the reference engine's hook on that norm normalises. Gemma's decoder
    layer hands the next one ``(post-feed-forward-norm output, residual)`` and the next
    ``input_layernorm`` adds them, so the sum is the stream between the two layers.

    ``_Gemma3WithTaps`` builds the parts vLLM's ``Gemma3ForCausalLM`` builds, with the tapped inner
    model in place of the plain one (vLLM names its inner class inside ``__init__``, so the base
    ``__init__`` cannot be reused; tests/engines/vllm/test_drift.py fails when vLLM's set of parts
    changes). The head is tied to the embeddings when the config says so, and the logits
    processor carries ``final_logit_softcapping`` (None for Gemma 3; a soft cap would send
    ``compute_logits`` down its dense-head path).
    """
    from torch import nn
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM, Gemma3Model
    from vllm.model_executor.models.utils import maybe_prefix

    class _TappedGemma3Model(Gemma3Model):
        esamp_aux_layers: tuple[int, ...] = ()

        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
            tapped = self.esamp_aux_layers
            if not tapped:
                return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
            # One stage holds every layer (the taps and the logits must be in one process).
            hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
            aux = []
            for index, layer in enumerate(self.layers):
                if index in tapped:
                    aux.append(hidden if residual is None else hidden + residual)
                hidden, residual = layer(positions, hidden, residual, **kwargs)
            hidden, _ = self.norm(hidden, residual)
            return hidden, aux

    class _Gemma3WithTaps(Gemma3ForCausalLM):
        def __init__(self, *, vllm_config, prefix: str = "") -> None:
            nn.Module.__init__(self)
            config = vllm_config.model_config.hf_config
            self.config = config
            self.quant_config = vllm_config.quant_config
            stages = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
            if stages > 1:
                raise ValueError(
                    f"ESamp's Gemma 3 tap runs on one pipeline stage, not {stages}: "
                    "start the engine without pipeline parallelism"
                )
            self.model = _TappedGemma3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                quant_config=self.quant_config,
                prefix=maybe_prefix(prefix, "lm_head"),
            )
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            self.logits_processor = LogitsProcessor(config.vocab_size, soft_cap=config.final_logit_softcapping)
            self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

        def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
            self.model.esamp_aux_layers = tuple(sorted(set(layers)))

    class EsampGemma3ForCausalLM(_TapMixin, _Gemma3WithTaps):
        pass

    _module_level(_TappedGemma3Model)  # the compiled class: its artifact is saved with it
    _module_level(_Gemma3WithTaps)
    return EsampGemma3ForCausalLM


EsampLlamaForCausalLM, EsampQwen2ForCausalLM = map(_module_level, _build())
EsampGemma3ForCausalLM = _module_level(_build_gemma3())
