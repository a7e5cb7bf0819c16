"""One ESamp step over a batch of rows, in the order it runs. Every engine runs this.

1. ``distill``: each row's group Distiller predicts ŷ from the source tap x; the row's error
   e = mean_H (ŷ − y)² against the target tap y is the novelty of the token that was its input;
   the rows that train take one optimizer step per slot (``esamp.core.distiller``).
2. ``filter``: z̃ = z / T, then the request's own min-p, top-k and top-p keep the candidates C;
   everything else becomes −∞ (``esamp.core.intervention.candidate_mask``).
3. ``mix``: z' = a·z̃ − b·d on C, with d = W_lm·ŷ the Distiller logits and (a, b) from the row's
   mix and β (``esamp.core.mixes``). Engines then sample from z' as they would from z̃.

An engine describes its steered rows once per batch shape as a ``StepPlan`` (each row's slot and
settings, as device tensors) and calls the three steps every decode step. The PyTorch functions
of ``esamp.core`` are the reference; faster backends plug into each step and tests hold each one
equal to the reference:

- distill: ``backends.graphs.GraphCache`` replays the step as a CUDA graph;
- filter: the vLLM engine passes vLLM's own top-k/top-p functions, so C is what vLLM keeps;
- mix: ``backends.triton_mix.mix_and_count`` is the mix and the candidate count in one pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from esamp.core import intervention as iv
from esamp.core.backends.graphs import GraphCache
from esamp.core.backends.triton_mix import mix_and_count
from esamp.core.config import Filters, Steering
from esamp.core.distiller import DistillerBank, RowLayout, Training


@dataclass(frozen=True)
class SteeredRow:
    """One row to steer: the slot of its group and the group's settings."""

    slot: int
    steering: Steering
    filters: Filters
    may_train: bool = True  # False holds this row's training back (its group is not all there yet)


def device_tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without blocking the host (pinned, non-blocking copy)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class StepPlan:
    """A batch of steered rows as device tensors. Built when the batch changes, reused after."""

    rows: int
    layout: RowLayout | None  # None for rows that are only filtered (``distill=False``)
    training: Training | None
    temperature: torch.Tensor  # [R, 1]; 1 for greedy rows (their argmax is what counts)
    top_k: torch.Tensor | None  # [R] long, 0 = off; None when no row uses top-k
    top_p: torch.Tensor | None  # [R]; None when no row uses top-p
    min_p: torch.Tensor | None  # [R]; None when no row uses min-p
    log_min_p: torch.Tensor | None  # [R, 1] log min_p (−∞ where off): min-p in logit space
    a: torch.Tensor  # [R, 1] weight of z̃ in the mix
    b: torch.Tensor  # [R, 1] weight of d
    key: int  # hash of (slot per row, rows that train): equal keys run the same Distiller step
    top_k_or_vocab: torch.Tensor | None  # [R] top-k with the vocabulary size where off (vLLM's form)

    @classmethod
    def build(cls, rows: Sequence[SteeredRow], device: torch.device | str = "cpu", *,
              vocab: int | None = None, distill: bool = True) -> "StepPlan":
        device = torch.device(device)

        def on(values, dtype=torch.float32):
            return device_tensor(values, dtype, device)

        slots = [r.slot for r in rows]
        trains, seen = [], set()
        for r in rows:  # train_rows "group": the group's first row in this step trains
            trains.append(r.may_train and r.steering.train and (r.steering.train_rows == "all" or r.slot not in seen))
            seen.add(r.slot)
        training = Training.of(slots, trains) if distill else None
        f = [r.filters for r in rows]
        a, b = iv.mix_coefficients([(r.steering.mix, r.steering.beta) for r in rows])
        top_k = [x.top_k for x in f]
        return cls(
            rows=len(rows),
            layout=RowLayout.from_slots(slots).to(lambda t: on(t.tolist(), t.dtype)) if distill else None,
            training=None if training is None else training.to(lambda t: on(t.tolist(), t.dtype)),
            temperature=on([[x.temperature if x.temperature > 0 else 1.0] for x in f]),
            top_k=on(top_k, torch.long) if any(k > 0 for k in top_k) else None,
            top_p=on([x.top_p for x in f]) if any(x.top_p < 1 for x in f) else None,
            min_p=on([x.min_p for x in f]) if any(x.min_p > 0 for x in f) else None,
            log_min_p=on([[math.log(x.min_p) if x.min_p > 0 else -math.inf] for x in f])
            if any(x.min_p > 0 for x in f) else None,
            a=a.to(device, non_blocking=True), b=b.to(device, non_blocking=True),
            # An int: a graph lookup per step hashes it for free (a long tuple would be re-hashed).
            key=hash((tuple(slots), tuple(trains))),
            top_k_or_vocab=on([k if 0 < k < vocab else vocab for k in top_k], torch.long)
            if vocab and any(0 < k < vocab for k in top_k) else None,
        )


def reference_filter(scaled: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """The core's candidate filter: −∞ outside C, in place."""
    R, V = scaled.shape
    mask = iv.candidate_mask(
        scaled,
        plan.top_k if plan.top_k is not None else torch.zeros(R, dtype=torch.long, device=scaled.device),
        plan.top_p if plan.top_p is not None else torch.ones(R, device=scaled.device),
        plan.min_p if plan.min_p is not None else torch.zeros(R, device=scaled.device))
    return scaled.masked_fill_(~mask, iv.NEG_INF)


Filter = Callable[[torch.Tensor, StepPlan], torch.Tensor]
Mix = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Steerer:
    """Runs ESamp's step over a ``StepPlan``'s rows with the given backends."""

    def __init__(self, bank: DistillerBank, *, filter: Filter = reference_filter, mix: Mix = mix_and_count,
                 graphs: GraphCache | None = None) -> None:
        self.bank = bank
        self._filter, self._mix = filter, mix
        self.graphs = graphs or GraphCache(enabled=False)

    def distill(self, plan: StepPlan, x: torch.Tensor, y: torch.Tensor, normalize=None,
                head_input: torch.Tensor | None = None):
        """(ŷ [R, H] fp32, e [R], per-slot loss of the training slots or None).

        ``normalize(x, y) -> (x, y)``, when given, turns the engine's raw taps into the Distiller's
        inputs inside the step. ``head_input`` ([R', H], the rows the engine runs its LM head on)
        makes ŷ come back stacked under them, ``[head_input; ŷ]`` in their dtype, ready for one
        head pass that gives both logits and d. Either way a graphed step launches nothing else.
        """
        def step(gx, gy, *head):
            if normalize is not None:
                gx, gy = normalize(gx, gy)
            prediction, errors, losses = self.bank.step(gx, gy, plan.layout, plan.training)
            if head:
                prediction = torch.cat([head[0], prediction.to(head[0].dtype)])
            return prediction, errors, losses

        inputs = (x, y) if head_input is None else (x, y, head_input)
        return self.graphs.run((plan.key, head_input is not None), step, *inputs, keep=plan)

    def filter(self, plan: StepPlan, logits: torch.Tensor) -> torch.Tensor:
        """z̃ = z/T with −∞ outside C, in place on ``logits`` ([R, V], fp32)."""
        return self._filter(logits.div_(plan.temperature), plan)

    def mix(self, plan: StepPlan, scaled: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z' = a·z̃ − b·d over the whole vocabulary, in place; also |C| per row."""
        return self._mix(scaled, d, plan.a, plan.b)

    def mix_at_candidates(self, plan: StepPlan, scaled: torch.Tensor, prediction: torch.Tensor,
                          lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same mix with d computed only at the candidates (|C| rows of the LM head per row)."""
        mask = torch.isfinite(scaled)
        counts = mask.sum(dim=-1)
        width = int(counts.max()) if counts.numel() else 1  # one host read: the widest row's |C|
        return iv.steer(scaled, mask, prediction, lm_head, plan.a, plan.b, width=width), counts
