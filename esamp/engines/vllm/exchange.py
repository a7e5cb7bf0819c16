"""``StepExchange``: where one engine's tap model and its live logits-processor adapter meet.

vLLM builds the model class and the logits processor separately, in the process that runs the
model, and calls them in this order every step: the adapter learns the batch (``update_state`` in
vLLM's V1 interface), the model's ``compute_logits`` runs, then the adapter's ``apply`` on the
sampler's logits. The exchange is the one object both hold; per step:

1. model: ``begin(rows)``: the live adapter's plan for this step's logits rows, or None (nothing
   to steer: the model runs its plain head);
2. model: ``put_taps(plan, ...)``: the Distiller step on the steered rows' taps; the model then
   hands back d = W·ŷ (or ŷ and its head's weight) with ``put_distiller_logits``;
3. adapter: ``take(plan)``: what the model put for this plan. A put for another plan is an error
   (``StepMismatch``): vLLM called the seam in an order the exchange does not know, and steering
   the wrong rows must never pass silently. Nothing put (a model class without taps) returns None.

An adapter that learns the step's rows only in ``apply`` (Model Runner V2 gives the row order to
its processors only then) attaches as ``late``: ``begin`` then has no plan, the model keeps every
row's taps with ``put_taps_late``, and the adapter runs the Distiller step from them with
``late_taps(plan)`` and its steering's ``step_late``, d coming from the model's LM head as its
factors (``HeadProduct``).

Both sides find their engine's exchange with ``exchange_for(vllm_config)`` (keyed by the
configuration object vLLM hands all of them), and each keeps it alive while it lives; the registry
holds weak references.
The engine's ``EngineSteering`` hangs off the exchange, so an adapter rebuilt by vLLM (its input
batch is re-made once the KV cache is sized) finds the same Distiller bank.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from esamp.core.intervention import HeadProduct
from esamp.engines.vllm.steering import BatchPlan, EngineSteering, Handoff

_EXCHANGES: dict[int, tuple] = {}  # id(vllm_config) → (weak reference to it, weak reference to its exchange)


class StepMismatch(RuntimeError):
    """The model and the logits processor disagree about the step they are in."""


def exchange_for(vllm_config) -> StepExchange:
    """The exchange of the engine ``vllm_config`` describes (made on first use).

    Keyed by the configuration object itself: vLLM hands the model, the logits processors and the
    worker the same object, and may change its fields (an engine core renames its instance), so
    nothing read from it would do."""
    key = id(vllm_config)
    config_ref, exchange_ref = _EXCHANGES.get(key, (None, None))
    exchange = exchange_ref() if exchange_ref is not None else None
    if exchange is None or config_ref() is not vllm_config:  # none yet, or an old config's id came back
        exchange = StepExchange(str(key))
        try:
            ref = weakref.ref(vllm_config)
        except TypeError:  # a configuration that takes no weak reference (tests): keep it alive
            ref = (lambda config: lambda: config)(vllm_config)
        _EXCHANGES[key] = (ref, weakref.ref(exchange))
    for dead in [k for k, (c, x) in _EXCHANGES.items() if c() is None or x() is None]:
        del _EXCHANGES[dead]
    return exchange


def live_exchanges() -> list[StepExchange]:
    return [x for _, ref in list(_EXCHANGES.values()) if (x := ref()) is not None]


class StepExchange:
    def __init__(self, key: str) -> None:
        self.key = key
        self.steering: EngineSteering | None = None
        self._adapter = None  # weak reference to the adapter that works
        self._model = None  # weak reference to the tap model
        self._handoff: Handoff | None = None
        self._late_taps = None  # (source, target, normalize, head dtype) of the taps kept this step
        self._head = None  # the model's LM head as a dense [V, H] matrix, once asked (``late_taps``)
        self.late = False  # the live adapter learns its rows only in apply
        self.taps_put = 0  # compute_logits calls that delivered taps

    # -- set-up ------------------------------------------------------------------------------

    def attach_adapter(
        self, adapter, make_steering: Callable[[], EngineSteering], late: bool = False
    ) -> EngineSteering:
        """Make ``adapter`` the one that works (the latest built; an earlier one stays out of the
        way: ``is_live``) and return the engine's steering, made on first use."""
        self._adapter = weakref.ref(adapter)
        self.late = late
        if self.steering is None:
            self.steering = make_steering()
        return self.steering

    def is_live(self, adapter) -> bool:
        return self._adapter is not None and self._adapter() is adapter

    @property
    def adapter(self):
        return self._adapter() if self._adapter is not None else None

    def attach_model(self, model) -> None:
        self._model = weakref.ref(model)
        self._head = None

    @property
    def model(self):
        return self._model() if self._model is not None else None

    # -- the model's side --------------------------------------------------------------------

    def begin(self, rows: int) -> BatchPlan | None:
        """A step with ``rows`` logits rows starts: the live adapter's plan, or None."""
        self._handoff = None
        self._late_taps = None
        adapter = self.adapter
        if adapter is None or self.steering is None or self.late:
            return None
        plan = adapter.plan(rows)
        return plan if plan is not None and plan.steered else None

    def put_taps(
        self, plan: BatchPlan, aux: torch.Tensor, source: int, target: int, normalize, head_dtype: torch.dtype
    ) -> torch.Tensor:
        """The Distiller step on ``plan``'s steered rows (``aux``: every logits row's tap columns);
        returns ŷ of those rows in ``head_dtype``, ready to stack under the head's input rows."""
        self.steering.keep_taps(aux)
        handoff = self.steering.distill(plan, source, target, normalize, head_dtype)
        self._handoff = handoff
        self.taps_put += 1
        return handoff.prediction[: plan.steered]

    def put_distiller_logits(self, plan: BatchPlan, d: torch.Tensor | HeadProduct) -> None:
        """d = W·ŷ [steered, V] for ``plan``'s steered rows, or its two factors."""
        if self._handoff is None or self._handoff.plan is not plan:
            raise StepMismatch("Distiller logits arrived for a step whose taps did not")
        self._handoff.d = d

    def warm_up(self, aux: torch.Tensor, source: int, target: int, normalize, head_dtype: torch.dtype) -> None:
        """A plain step before any request (vLLM's start-up): capture the Distiller's graphs and the
        filter-and-mix's (those read the LM head where this worker holds it whole)."""
        steering = self.steering  # (called on every plain step: once prepared, nothing more)
        if steering is not None and steering.slots is not None and steering.unprepared:
            steering.prepare(aux, source, target, normalize, head_dtype, self._prepared_head())

    def _prepared_head(self) -> torch.Tensor | None:
        """The LM head the filter-and-mix's graphs are captured with before any request: the dense
        weight where the model has one; for a late adapter also a head it must materialise (a
        quantised one: its first steered step would, ``late_taps``). None under tensor
        parallelism without the whole head (gathering it is a collective, left to the step)."""
        model = self.model
        if model is None:
            return None
        weight = model.esamp_dense_weight()
        if weight is not None or not self.late or getattr(model, "esamp_head_sharded", False):
            return weight
        if self._head is None:
            self._head = model.esamp_lm_head()
        return self._head

    def put_taps_late(self, aux: torch.Tensor, source: int, target: int, normalize, head_dtype: torch.dtype) -> None:
        """For a late adapter with rows to steer: keep every logits row's taps for its ``apply``
        (a tensor-parallel worker without the bank keeps none, and notes that they came: it
        receives ŷ from rank 0 in the same step)."""
        adapter, steering = self.adapter, self.steering
        if not self.late or adapter is None or steering is None or steering.slots is None or not adapter.has_rows():
            return  # (no slots: an engine without ESamp, which steers nothing)
        if steering.keep_taps(aux):
            self._late_taps = (source, target, normalize, head_dtype)
            self.taps_put += 1

    def late_taps(self, plan: BatchPlan) -> tuple | None:
        """For a late adapter, in ``apply``: what its steering's ``step_late`` runs the Distiller
        step from, (source, target, normalize, head dtype, the model's LM head) of the taps kept
        this step, or None when no taps came (or ``plan`` steers nothing). d = W·ŷ then comes as
        its factors, ŷ and this head: the steering computes it at the candidates, or multiplies it
        out for rows whose candidates may be every token (``plan.few_candidates``)."""
        taps, self._late_taps = self._late_taps, None
        model = self.model
        if taps is None or model is None or not plan.steered:
            return None
        if self._head is None:
            # The same tensor every step (weights change in place). A worker holding one shard of
            # the head gathers it whole here, at the same step on every worker.
            self._head = model.esamp_lm_head()
        return (*taps, self._head)

    # -- the adapter's side ------------------------------------------------------------------

    def take(self, plan: BatchPlan) -> Handoff | None:
        """What the model put for ``plan`` this step (None when no taps came)."""
        handoff, self._handoff = self._handoff, None
        if handoff is None:
            return None
        if handoff.plan is not plan:
            raise StepMismatch(
                "ESamp: the logits processor's rows are not the rows the model tapped this "
                "step; this vLLM calls its model and its logits processors in an order esamp "
                "does not support (see the supported versions in docs/vllm.md)"
            )
        return handoff
