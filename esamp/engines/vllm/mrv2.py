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
  (``distill_late``) and gets d = W·ŷ as ŷ and the model's LM head (``HeadProduct``), then
  filters and mixes. The plan is rebuilt only when the row → slot order or a slot changed.
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

Inert when another adapter of the engine is the live one (``StepExchange.is_live``), and for
requests without ESamp settings: ``add_request`` answers False, so vLLM skips every processor for
a batch of such requests.
"""

from __future__ import annotations

import time
import weakref

import numpy as np
import torch

from esamp.engines.vllm import settings as es
from esamp.engines.vllm.exchange import exchange_for
from esamp.engines.vllm.rows import RequestRow, request_row
from esamp.engines.vllm.steering import BatchPlan, EngineSteering, make_steering

try:  # vLLM ≥ 0.31
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcessor, LogitsProcRequestState
except ImportError as exc:  # pragma: no cover - depends on the installed vLLM
    raise ImportError(f"this vLLM has no Model Runner V2 logits-processor interface: {exc}") from exc


class _Generated:
    """Stands in for V1's live list of a request's generated ids, as the request's identity
    (``Groups.sample_of``): MRV2 keeps no such list, and the adapter hands ``EngineSteering.apply``
    every steered row's generation index at once."""

    __slots__ = ()

    def __len__(self) -> int:
        return 0


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


class Mrv2Adapter(LogitsProcessor):
    """ESamp on the rows of requests that ``validate_params`` prepared (Model Runner V2)."""

    steering_class = EngineSteering

    def __init__(self, vllm_config, req_states: LogitsProcRequestState) -> None:
        why = refusal(vllm_config)
        if why is not None:
            raise ValueError(why)
        self.req_states = req_states
        self.slots: dict[int, RequestRow] = {}  # slot → its request's row (ESamp requests only)
        self._plan: BatchPlan | None = None
        self._rows: dict[int, RequestRow] = {}  # this plan's rows by logits row
        self._order: bytes | None = None  # the row → slot order the plan was built for (its bytes)
        self._member_rows = np.zeros(0, dtype=np.intp)  # the plan's steered rows
        self._member_prompts = np.zeros(0, dtype=np.int64)  # their requests' prompt lengths
        self.exchange = exchange_for(vllm_config)
        self.steering = self.exchange.attach_adapter(
            self, lambda: make_steering(vllm_config, torch.device(req_states.device), self.steering_class), late=True
        )
        self.steering.forget_rows = weakref.WeakMethod(self.forget)

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """``settings.prepare``: not only a check; a request ESamp steers gets its group, and its
        filters are handed to ESamp (``settings.hand_filters_to_esamp``: vLLM keeps neutral ones)."""
        es.prepare(sampling_params)

    def add_request(self, req_idx: int, sampling_params) -> bool:
        """A request took slot ``req_idx`` (whatever held it before is gone); True when it is ours."""
        self._order = None
        row = None
        if self.exchange.is_live(self):
            steering = self.steering
            row = request_row(
                sampling_params.extra_args,
                sampling_params.seed,
                _Generated(),
                steering.groups,
                steering.config,
                steering.record_all,
            )
        if row is None:
            self.slots.pop(req_idx, None)
            return False
        self.slots[req_idx] = row
        return True

    def has_rows(self) -> bool:
        """Whether any slot holds an ESamp request (the model then keeps the step's taps). A
        finished request keeps its slot until the slot is reused: MRV2 does not say it left."""
        return bool(self.slots)

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not self.slots or not self.exchange.is_live(self):
            return logits
        started = time.perf_counter()
        order = ctx.idx_mapping_np
        if logits.shape[0] != len(order):  # refused at start (``refusal``); never steer rows we cannot place
            raise RuntimeError(
                f"ESamp: {logits.shape[0]} logits rows for {len(order)} requests; ESamp needs one "
                "row per request (no speculative decoding)"
            )
        key = order.tobytes()  # (a byte string compares in one call; the order is a few hundred ints)
        if key != self._order:
            self._rows = {i: row for i, slot in enumerate(order.tolist()) if (row := self.slots.get(slot)) is not None}
            self._plan = self.steering.plan(self._rows, logits.shape[0]) if self._rows else None
            self._order = key
            if self._plan is not None:
                self._member_rows = np.asarray(self._plan.member_rows, dtype=np.intp)
                # a slot's prompt length stays while its request does (a new request rebuilds the plan)
                self._member_prompts = self.req_states.prompt_len.np[order[self._member_rows]].astype(np.int64)
        plan = self._plan
        if plan is None:
            return logits  # no request of ours in this batch
        # Each steered row's generation index, in one array operation (a batch holds hundreds of
        # rows); the step's record keeps the array (``RecordStore``: readers get lists).
        generated = np.maximum(ctx.seq_lens_upper_bound_np[self._member_rows] - self._member_prompts, 0)
        return self.steering.apply(plan, logits, self.exchange.distill_late(plan), generated, started)

    def forget(self, group: str) -> None:
        """``group`` is over (its client said so): drop its rows (``EngineSteering.release`` calls
        this before freeing the slot)."""
        for slot in [s for s, r in self.slots.items() if r.group == group]:
            del self.slots[slot]
            self._order = None
