"""``V1Adapter``: ESamp's adapter for vLLM's V1 logits-processor interface (``mrv2.Mrv2Adapter``
is Model Runner V2's; ``entry.EsampLogitsProcessor``, the class vLLM builds, picks one of the two).

One job: turn vLLM's V1 batch bookkeeping into ESamp rows, and its ``apply`` into ESamp's. Rows
are mapped fresh from every ``BatchUpdate`` with vLLM's own ``process_dict_updates`` (batch
index → ``RequestRow``; state is keyed by group in ``EngineSteering``, never by row). The model's
``compute_logits`` asks for this step's plan through the engine's ``StepExchange`` and puts its
taps; ``apply`` takes what it put and lets ``EngineSteering`` filter and mix the sampler's logits.

Loaded into every vLLM engine of the environment by the ``vllm.logits_processors`` entry point
(vLLM 0.20 then does not wait for each step's sampled tokens, which it does for processors passed
by name), it is inert where an engine has no ESamp settings (``additional_config``): a request
without ESamp settings costs one call that returns at once. An ESamp request that lands in such an
engine, or finds every slot held by a running group, still gets its own filters: sampled plainly,
never steered with another group's Distiller.
"""

from __future__ import annotations

import weakref

import torch

from esamp.engines.vllm import settings as es
from esamp.engines.vllm.exchange import exchange_for
from esamp.engines.vllm.rows import request_row
from esamp.engines.vllm.steering import BatchPlan, EngineSteering, make_steering

try:  # the V1 runner's interface (Model Runner V2's has its own adapter: mrv2.py)
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates
except ImportError as exc:  # pragma: no cover - depends on the installed vLLM
    raise ImportError(f"this vLLM has no V1 logits-processor interface: {exc}") from exc


class V1Adapter(LogitsProcessor):
    """ESamp on the rows of requests that ``validate_params`` prepared."""

    steering_class = EngineSteering

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict = {}
        self._plan: BatchPlan | None = None
        self._sampled = False  # this step's sampler has run (a later compute_logits is not ours)
        self.exchange = exchange_for(vllm_config)
        self.steering = self.exchange.attach_adapter(
            self, lambda: make_steering(vllm_config, torch.device(device), self.steering_class)
        )
        self.steering.forget_rows = weakref.WeakMethod(self.forget)

    @classmethod
    def validate_params(cls, params) -> None:
        """``settings.prepare``: not only a check; a request ESamp steers gets its group, and its
        filters are handed to ESamp (``settings.hand_filters_to_esamp``: vLLM keeps neutral ones)."""
        es.prepare(params)

    def is_argmax_invariant(self) -> bool:
        return False  # ESamp moves the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self._sampled = False  # vLLM calls this at the start of every step
        if batch_update is None or not self.exchange.is_live(self):
            return
        steering = self.steering
        if process_dict_updates(
            self.rows,
            batch_update,
            lambda params, _prompt, output: request_row(
                params.extra_args, params.seed, output, steering.groups, steering.config, steering.record_all
            ),
        ):
            self._plan = None

    def has_rows(self) -> bool:
        return bool(self.rows)

    def plan(self, rows: int) -> BatchPlan | None:
        """This step's plan for ``rows`` logits rows, or None when no row is ours, or when the
        step's sampler has run (vLLM computes prompt logprobs with a second ``compute_logits`` on
        the prompt rows after sampling: those rows are not the batch's)."""
        if not self.rows or self._sampled:
            return None
        plan = self._plan
        if plan is None or plan.rows != rows:
            plan = self._plan = self.steering.plan(self.rows, rows)
        return plan

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows or not self.exchange.is_live(self):
            return logits
        plan = self.plan(logits.shape[0])
        self._sampled = True
        return self.steering.apply(plan, logits, self.exchange.take(plan))

    def forget(self, group: str) -> None:
        """``group`` is over (its client said so): drop its rows, which may still be in the batch
        until the next step (``EngineSteering.release`` calls this before freeing the slot)."""
        for index in [i for i, r in self.rows.items() if r.group == group]:
            del self.rows[index]
            self._plan = None
