"""Flat parameter storage and the fused optimizer step for the Distiller bank.

Speed machinery: ``esamp.core.distiller`` holds the algorithm; this file holds how its numbers
are stored and updated so that a step inside vLLM's sampler reads and writes each value once.

Every slot's trained tensors live in one fp32 row of a [S, P] buffer (a slot's tensors are views
of its row), and so do the two Adam moments. A step over consecutive slots reads their rows in
place (``rows``), and one multi-tensor call (``torch._fused_adam_``, the kernel behind
``torch.optim.Adam(fused=True)``) updates every slot's views with that slot's own step count.
Tests hold the result equal to ``torch.optim.Adam``/``SGD`` run slot by slot.
"""

from __future__ import annotations

import math

import torch

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


class FlatParameters:
    """``slots`` copies of the tensors named in ``shapes``, in one [S, P] fp32 buffer."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], slots: int, device: torch.device) -> None:
        self.shapes = dict(shapes)
        self.spans: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, shape in self.shapes.items():
            size = math.prod(shape)
            self.spans[name] = (offset, offset + size)
            offset += size
        kw = dict(device=device, dtype=torch.float32)
        self.flat = torch.empty(slots, offset, **kw)  # [S, P] every slot's parameters
        self.flat_m = torch.zeros(slots, offset, **kw)  # Adam first moment
        self.flat_v = torch.zeros(slots, offset, **kw)  # Adam second moment
        self.steps = torch.zeros(slots, **kw)  # optimizer steps per slot (Adam's bias correction)
        self.params = self.named(self.flat)
        self.exp_avg = self.named(self.flat_m)
        self.exp_avg_sq = self.named(self.flat_v)

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """``name``'s [rows, *shape] view of a [rows, P] buffer (no copy)."""
        a, b = self.spans[name]
        return buffer[:, a:b].view(buffer.shape[0], *self.shapes[name])

    def named(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: self.view(buffer, name) for name in self.shapes}

    def rows(self, slots: tuple[int, ...], active: torch.Tensor) -> torch.Tensor:
        """[U, P]: the rows of ``slots``, in place when they are consecutive ascending ids."""
        if slots and all(b == a + 1 for a, b in zip(slots, slots[1:])):
            return self.flat[slots[0]:slots[-1] + 1]
        return self.flat.index_select(0, active)

    @torch.no_grad()
    def reset(self, slot: int, values: dict[str, torch.Tensor]) -> None:
        """Set a slot's tensors and clear its optimizer state."""
        for name, value in values.items():
            self.params[name][slot].copy_(value)
        self.flat_m[slot].zero_()
        self.flat_v[slot].zero_()
        self.steps[slot] = 0

    @torch.no_grad()
    def update(self, slots: tuple[int, ...], grads: dict[str, torch.Tensor], optimizer: str, lr: float) -> None:
        """One SGD or Adam step on ``slots``' views, in place; ``grads``: name → [len(slots), ...]."""
        names = list(self.shapes)
        params = [self.params[k][s] for k in names for s in slots]
        # The fused kernels walk each tensor's memory in order: a strided gradient would be misread.
        g = [grads[k][u].contiguous() for k in names for u in range(len(slots))]
        step_of = [self.steps[s] for s in slots]
        torch._foreach_add_(step_of, 1.0)
        if optimizer == "sgd":
            torch._foreach_add_(params, g, alpha=-lr)
            return
        b1, b2 = ADAM_BETAS
        torch._fused_adam_(params, g, [self.exp_avg[k][s] for k in names for s in slots],
                           [self.exp_avg_sq[k][s] for k in names for s in slots], [],
                           step_of * len(names), lr=lr, beta1=b1, beta2=b2, weight_decay=0.0,
                           eps=ADAM_EPS, amsgrad=False, maximize=False)
