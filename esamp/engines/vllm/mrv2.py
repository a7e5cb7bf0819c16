"""``EsampMrv2LogitsProcessor``: ESamp on Model Runner V2's logits-processor interface (vLLM ≥ 0.31).

Draft over the V1 adapter (``processor.EsampLogitsProcessor``), which it holds as its core: the
groups and their Distiller slots, the steerer, the records and ``drain`` are the V1 adapter's, so
both runners steer with the same code. What differs is only how rows are known:

- V1 hands ``BatchUpdate``s (added / removed / moved rows) before the forward pass; MRV2 calls
  ``add_request(slot, params)`` when a request takes a slot (slots are recycled, there is no
  remove call) and gives the step's row → slot order only to ``apply(logits, ctx)``
  (``ctx.idx_mapping_np``), after the model's ``compute_logits`` ran.
- V1's rows carry the live list of generated ids (its length is the generation index); MRV2 has
  none on the host, so the index is ``seq_lens_upper_bound_np[row] - prompt_len[slot]`` (exact
  without speculative decoding, which ESamp refuses), 0 for a partial prefill as in V1.
- MRV2 applies custom processors before temperature, min-p and top-k/top-p (V1: before the
  argmax-invariant ones too, ESamp being non-invariant); either way vLLM was handed neutral
  filters by ``settings.prepare`` and ESamp filters with the request's own inside ``apply``.

What this draft does not do yet: steer. MRV2 calls the model's ``compute_logits`` before it
tells any processor the step's row order, and the model consumes the taps there (it asks the
processor's ``plan`` which rows to tap and runs the Distiller step, training included). With the
previous step's order the Distiller would train on another request's rows whenever the batch
changed, so ``plan`` answers None here: the model runs its plain head, and ``apply`` filters every
ESamp row exactly with its own filters (counted as ``stash_miss`` for steered rows). Steering
needs the per-step exchange the vLLM seam is being restructured around: the model leaves the
step's tapped rows there, and ``apply``, which has the order, runs the Distiller step and the head
on ŷ before the mix (or the model learns the order before the forward from MRV2's model-state
hook, ``get_model_state_cls().prepare_inputs(input_batch)``).
"""

from __future__ import annotations

from esamp.engines.vllm import settings as es
from esamp.engines.vllm.processor import EsampLogitsProcessor, _Row
from esamp.engines.vllm.state import STATE

try:  # vLLM ≥ 0.31
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcessor, LogitsProcRequestState
except ImportError:  # pragma: no cover - a vLLM without Model Runner V2's processor interface
    LogitsContext = LogitsProcessor = LogitsProcRequestState = None


class _Generated:
    """Stands in for V1's live list of a request's generated ids: only its length is read, the
    generation index of the token sampled this step (set by the adapter before each ``apply``)."""

    __slots__ = ("index",)

    def __init__(self) -> None:
        self.index = 0

    def __len__(self) -> int:
        return self.index


if LogitsProcessor is not None:

    class EsampMrv2LogitsProcessor(LogitsProcessor):
        """ESamp on the rows of requests that ``validate_params`` prepared (MRV2 interface)."""

        def __init__(self, vllm_config, req_states: LogitsProcRequestState) -> None:
            self.req_states = req_states
            self.core = EsampLogitsProcessor(vllm_config, req_states.device, False)
            self.slots: dict[int, _Row] = {}  # request slot → its row settings (ESamp requests only)
            if self.core.working:
                STATE.set_processor(self)  # the model and the worker extension reach the core through us

        @classmethod
        def validate_params(cls, sampling_params) -> None:
            es.prepare(sampling_params)

        def add_request(self, req_idx: int, sampling_params) -> bool:
            """A request took slot ``req_idx`` (the slot's last occupant is gone)."""
            row = self.core._new_row(sampling_params, None, _Generated()) if self.core.working else None
            if row is None:
                self.slots.pop(req_idx, None)
                return False  # vLLM skips every processor for a batch where no request needs one
            self.slots[req_idx] = row
            return True

        def apply(self, logits, ctx: LogitsContext):
            core = self.core
            if not self.slots or logits.shape[0] != len(ctx.idx_mapping_np):
                return logits  # no ESamp request; or draft rows (speculative decoding: refused by ESamp)
            prompt = self.req_states.prompt_len.np
            seen = ctx.seq_lens_upper_bound_np
            rows = {}
            for index, slot in enumerate(ctx.idx_mapping_np.tolist()):
                row = self.slots.get(slot)
                if row is not None:
                    row.output_ids.index = max(0, int(seen[index]) - int(prompt[slot]))
                    rows[index] = row
            if rows != core.rows:
                core.rows = rows
                core._plan = None
            return core.apply(logits)

        # -- what the model and the worker extension call (the V1 adapter's, on our rows) ------

        def plan(self, rows: int):
            return None  # the row order is not known before apply (module docstring)

        def distill(self, *args, **kwargs):
            return self.core.distill(*args, **kwargs)

        def take_distiller_logits(self, d) -> None:
            self.core.take_distiller_logits(d)

        def release(self, group: str) -> None:
            for slot in [s for s, r in self.slots.items() if r.group == group]:
                del self.slots[slot]  # a finished request's slot keeps it until it is reused
            self.core.release(group)

        def drain(self, release=(), groups=None) -> dict:
            for group in release:
                self.release(group)
            return self.core.drain((), groups)

        def __getattr__(self, name: str):  # counters, records, bank, metrics, ...: the core's
            if name == "core":
                raise AttributeError(name)
            return getattr(self.core, name)

else:  # pragma: no cover
    EsampMrv2LogitsProcessor = None
