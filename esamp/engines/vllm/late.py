"""``LateAdapter``: the work of ESamp's Model Runner V2 adapter (``mrv2.Mrv2Adapter``), without
vLLM's base class, so that it runs, and is measured (``benchmarks/host_micro.py``), where no vLLM
with MRV2's interface is installed. ``mrv2.py`` says what MRV2 does differently from the V1 runner
and how this adapter answers it; this module is that answer.

What it reads of MRV2 (``req_states``, a step's ``ctx``): ``req_states.device``,
``req_states.prompt_len.np`` (each slot's prompt length), ``ctx.idx_mapping_np`` (row → slot) and
``ctx.seq_lens_upper_bound_np`` (each row's tokens so far); tests/engines/vllm/test_drift.py holds
vLLM's classes to those names.
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


class _Generated:
    """Stands in for V1's live list of a request's generated ids, as the request's identity
    (``Groups.sample_of``): MRV2 keeps no such list, and the adapter hands ``EngineSteering.apply``
    every steered row's generation index at once."""

    __slots__ = ()

    def __len__(self) -> int:
        return 0


class LateAdapter:
    """ESamp on the rows of requests that ``validate_params`` prepared, kept by slot, placed in ``apply``."""

    steering_class = EngineSteering

    def __init__(self, vllm_config, req_states) -> None:
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

    def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
        if not self.slots or not self.exchange.is_live(self):
            return logits
        started, started_cpu = time.perf_counter(), time.thread_time()
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
        return self.steering.step_late(plan, logits, self.exchange.late_taps(plan), generated, started, started_cpu)

    def forget(self, group: str) -> None:
        """``group`` is over (its client said so): drop its rows (``EngineSteering.release`` calls
        this before freeing the slot)."""
        for slot in [s for s, r in self.slots.items() if r.group == group]:
            del self.slots[slot]
            self._order = None
