"""``FlatDistillerBank``: the core Distiller bank with its storage laid out for a GPU hot path.

Same Distillers, same initialisation, same loss and the same Adam/SGD arithmetic as
``esamp.distiller.DistillerBank`` (a test checks they agree). What changes is storage: each
slot's six parameter tensors are views into one [S, P] buffer, and so are the two Adam moments.
A step then gathers its slots with one ``index_select`` and updates them with a dozen whole-
buffer ops instead of a dozen per parameter tensor, and ``predict_and_train`` takes the
prediction from the training forward pass instead of running the network twice. Inside vLLM's
sampler every kernel launch is paid on the step's critical path, so the op count is what matters.
"""

from __future__ import annotations

import math

import torch

from esamp.distiller import ADAM_BETAS, ADAM_EPS, DistillerBank, RowLayout


class FlatDistillerBank(DistillerBank):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        S = self.capacity
        self._shapes = {k: tuple(v.shape[1:]) for k, v in self.params.items()}
        self._spans: dict[str, tuple[int, int]] = {}
        offset = 0
        for k in self.PARAMS:
            n = math.prod(self._shapes[k])
            self._spans[k] = (offset, offset + n)
            offset += n
        self.width = offset
        kw = dict(device=self.device, dtype=torch.float32)
        self.flat = torch.empty(S, offset, **kw)
        self.flat_m = torch.zeros(S, offset, **kw)
        self.flat_v = torch.zeros(S, offset, **kw)
        for k in self.PARAMS:
            self.flat_view(self.flat, k).copy_(self.params[k])
        # From here on the dicts the core code uses are views into the flat buffers.
        self.params = {k: self.flat_view(self.flat, k) for k in self.PARAMS}
        self.exp_avg = {k: self.flat_view(self.flat_m, k) for k in self.PARAMS}
        self.exp_avg_sq = {k: self.flat_view(self.flat_v, k) for k in self.PARAMS}

    def flat_view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        a, b = self._spans[name]
        return buffer[:, a:b].view(buffer.shape[0], *self._shapes[name])

    def _gather(self, layout: RowLayout) -> dict[str, torch.Tensor]:
        rows = self.flat.index_select(0, layout.active)
        return {k: self.flat_view(rows, k) for k in self.PARAMS}

    def predict_and_train(self, x: torch.Tensor, y: torch.Tensor, layout: RowLayout):
        """One pass for a step where every row trains: (ŷ [R, H], e [R], per-slot loss [U]).

        ŷ and e come from the parameters before this step's update, exactly what ``predict`` and
        ``row_error`` would give; the update equals ``train_step``'s.
        """
        with torch.inference_mode(False), torch.enable_grad():
            x = x.detach().float().clone()
            y = y.detach().float().clone()
            rows = self.flat.index_select(0, layout.active).requires_grad_(True)
            p = {k: self.flat_view(rows, k) for k in self.PARAMS}
            prediction = self._forward(x, layout, p)
            err = self.row_error(prediction, y)
            U = layout.active.numel()
            per_slot = torch.zeros(U, device=err.device).index_add(0, layout.row_slot, err)
            count = torch.zeros(U, device=err.device).index_add(0, layout.row_slot, torch.ones_like(err))
            loss = per_slot / count
            (grad,) = torch.autograd.grad(loss.sum(), [rows])
        self._flat_update(layout.active, grad)
        return prediction.detach(), err.detach(), loss.detach()

    def train_step(self, x: torch.Tensor, y: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        return self.predict_and_train(x, y, layout)[2]

    @torch.no_grad()
    def _flat_update(self, active: torch.Tensor, grad: torch.Tensor) -> None:
        """The core's per-slot SGD/Adam, on whole [U, P] rows at once."""
        self.steps[active] += 1
        if self.optimizer == "sgd":
            self.flat.index_add_(0, active, -self.lr * grad)
            return
        b1, b2 = ADAM_BETAS
        t = self.steps[active].reshape(-1, 1)
        m = self.flat_m.index_select(0, active).mul_(b1).add_(grad, alpha=1 - b1)
        v = self.flat_v.index_select(0, active).mul_(b2).addcmul_(grad, grad, value=1 - b2)
        self.flat_m.index_copy_(0, active, m)
        self.flat_v.index_copy_(0, active, v)
        update = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + ADAM_EPS)
        self.flat.index_add_(0, active, -self.lr * update)
