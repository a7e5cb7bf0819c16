"""``Mrv2Adapter``: ESamp's adapter for Model Runner V2's logits-processor interface
(vLLM ≥ 0.31; ``v1.V1Adapter`` is the V1 runner's).

One job, as the V1 adapter's: turn MRV2's bookkeeping into ESamp rows and its ``apply`` into
``EngineSteering``'s. What MRV2 does differently:

- Requests are kept by slot. ``add_request(slot, params)`` says a request took a slot; nothing says
  it left (slots are recycled: the next ``add_request`` overwrites everything the slot held).
  A resumed request is added again.
- The step's order of logits rows (row → slot, ``ctx.idx_mapping_np``) is known only in
  ``apply``, after the model's ``compute_logits`` ran. So this adapter attaches to the engine's
  ``StepExchange`` as *late*: the model keeps every row's taps there (``put_taps_late``), and
  ``apply``, which has the order, runs the Distiller step on the steered rows
  (``EngineSteering.step_late``) and gets d = W·ŷ as ŷ and the model's LM head (``HeadProduct``),
  then filters and mixes; with the update in line (a block of up to 128 cells under the default
  ESAMP_UPDATE=auto, every block with inline) a plan's steps are one CUDA graph each from its
  third step on. The plan is rebuilt only when the row → slot order or a
  slot changed.
- No host list of generated ids: every steered row's generation index comes from one array
  operation a step, ``seq_lens_upper_bound_np[row] - prompt_len[slot]`` (exact without speculative
  decoding, which ESamp refuses; 0 during a partial prefill, as V1's empty list).
- ``apply`` runs before vLLM's temperature, min-p and top-k/top-p, as in V1 for a processor that
  moves the argmax; ``settings.prepare`` handed vLLM neutral filters and ESamp applies the
  request's own inside ``apply``.

Under tensor parallelism every worker runs this adapter on the same rows, as on the V1 runner
(``esamp.engines.vllm.tp``): rank 0 runs the Distiller step in ``apply`` and broadcasts ŷ, every
other worker receives it, and each computes d from the whole LM head, which a worker holding one
vocabulary shard gathers once (``esamp_lm_head``: [V, H] more memory per worker), so every worker
filters and mixes identical inputs.

The work itself is ``late.LateAdapter`` (importable without vLLM); this class puts it on vLLM's
interface and refuses an engine it cannot serve.

Inert when another adapter of the engine is the live one (``StepExchange.is_live``), and for
requests without ESamp settings: ``add_request`` answers False, so vLLM skips every processor for
a batch of such requests.
"""

from __future__ import annotations

from esamp.engines.vllm.late import LateAdapter

try:  # vLLM ≥ 0.31
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor, LogitsProcRequestState
except ImportError as exc:  # pragma: no cover - depends on the installed vLLM
    raise ImportError(f"this vLLM has no Model Runner V2 logits-processor interface: {exc}") from exc


def refusal(vllm_config) -> str | None:
    """Why this engine cannot run ESamp's MRV2 adapter, or None. ESamp needs one logits row per
    request and step, and the rows through the model's own ``compute_logits``."""
    if getattr(vllm_config, "speculative_config", None) is not None:
        return (
            "ESamp does not run with speculative decoding (a steered request needs one logits row per "
            "step): start the engine without a speculative config"
        )
    parallel = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel, "enable_batch_sharded_sampling", False):
        return (
            "ESamp does not run with batch-sharded sampling (it bypasses the ESamp model's "
            "compute_logits): start the engine without enable_batch_sharded_sampling"
        )
    return None


class Mrv2Adapter(LateAdapter, LogitsProcessor):
    """ESamp on the rows of requests that ``validate_params`` prepared (Model Runner V2)."""

    def __init__(self, vllm_config, req_states: LogitsProcRequestState) -> None:
        why = refusal(vllm_config)
        if why is not None:
            raise ValueError(why)
        super().__init__(vllm_config, req_states)
