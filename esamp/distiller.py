"""The Distiller bank: one small network per prompt group, trained online while the LLM decodes.

Each slot s holds a low-rank gated residual followed by a LayerNorm,

    ŷ = LN(x + ((x·A) ⊙ SiLU(x·G + b))·B)        A, G ∈ R^{H×r}, B ∈ R^{r×H}, b ∈ R^r

predicting the deep tap y from the shallow tap x.  Per row, e = mean_H (ŷ − y)² is both the loss
term and the raw novelty.  One optimizer step per decode step minimises, for every slot with rows
in the step, the mean of e over that slot's rows; slots never share parameters or optimizer state,
and each slot counts its own optimizer steps, so a re-initialised slot starts exactly fresh.

Parameters are stacked over slots ([S, H, r] ...) and kept in fp32.  A step's rows are laid out
as a [U, W, H] block (U slots present in the step, W rows of the widest slot) so every slot's
product is one batched matmul and no per-row copy of the parameters is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from esamp.errors import BankFullError

INIT_STD = 0.02
LN_EPS = 1e-5
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


@dataclass(frozen=True)
class RowLayout:
    """Where each row of a step sits in the [U, W, H] slot block. Built fresh every step."""

    active: torch.Tensor  # [U] slot ids present in this step
    row_slot: torch.Tensor  # [R] index into ``active`` for each row
    row_pos: torch.Tensor  # [R] position of the row inside its slot's block
    width: int  # W: rows of the widest slot in this step

    @classmethod
    def from_slots(cls, slots: list[int], device: torch.device | str = "cpu") -> "RowLayout":
        """Layout for rows whose slots are ``slots`` (host ints, in row order)."""
        order: dict[int, int] = {}
        counts: list[int] = []
        row_slot, row_pos = [], []
        for s in slots:
            u = order.setdefault(s, len(order))
            if u == len(counts):
                counts.append(0)
            row_slot.append(u)
            row_pos.append(counts[u])
            counts[u] += 1

        def t(values):
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(t(list(order)), t(row_slot), t(row_pos), max(counts, default=0))


class DistillerBank:
    """``slots`` Distillers of rank ``rank`` over hidden size ``hidden``, keyed by group."""

    PARAMS = ("A", "G", "b", "B", "ln_w", "ln_b")

    def __init__(
        self,
        hidden: int,
        rank: int = 64,
        slots: int = 64,
        lr: float = 1e-3,
        optimizer: str = "adam",
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', not {optimizer!r}")
        self.hidden, self.rank, self.capacity = hidden, rank, slots
        self.lr, self.optimizer = lr, optimizer
        self.device = torch.device(device)
        self.seed = seed
        H, r, S = hidden, rank, slots
        kw = dict(device=self.device, dtype=torch.float32)
        self.params: dict[str, torch.Tensor] = {
            "A": torch.empty(S, H, r, **kw),
            "G": torch.empty(S, H, r, **kw),
            "b": torch.empty(S, r, **kw),
            "B": torch.empty(S, r, H, **kw),
            "ln_w": torch.empty(S, H, **kw),
            "ln_b": torch.empty(S, H, **kw),
        }
        self.exp_avg = {k: torch.zeros_like(p) for k, p in self.params.items()}
        self.exp_avg_sq = {k: torch.zeros_like(p) for k, p in self.params.items()}
        self.steps = torch.zeros(S, device=self.device, dtype=torch.float32)
        self._groups: dict[str, int] = {}
        self._free: list[int] = list(range(S - 1, -1, -1))  # pop() hands out slot 0 first
        self._init_gen = torch.Generator(device="cpu")
        self.reset_slots(torch.arange(S))

    # -- slots -------------------------------------------------------------------------------

    @property
    def groups(self) -> dict[str, int]:
        """group key → slot, for the groups holding a slot now."""
        return dict(self._groups)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self, group: str) -> int:
        """The slot of ``group``, taking a fresh one on first sight. Never reuses a held slot."""
        if group in self._groups:
            return self._groups[group]
        if not self._free:
            raise BankFullError(
                f"all {self.capacity} Distiller slots are held by running prompt groups",
                hint="wait for a group to finish, abort one, or start with more slots (--slots)",
            )
        slot = self._free.pop()
        self._groups[group] = slot
        return slot

    def free(self, group: str) -> None:
        """Release ``group``'s slot and re-initialise it, so the next holder starts fresh."""
        slot = self._groups.pop(group, None)
        if slot is None:
            return
        self.reset_slots(torch.tensor([slot]))
        self._free.append(slot)

    def slot_of(self, group: str) -> int:
        return self._groups[group]

    @torch.no_grad()
    def reset_slots(self, slots: torch.Tensor) -> None:
        """Fresh weights (A, G, B ~ N(0, 0.02²), b = 1, LN affine 1/0) and optimizer state.

        Initial weights depend only on (seed, slot), so a slot reset mid-run equals a new bank's.
        """
        H, r = self.hidden, self.rank
        for s in slots.tolist():
            self._init_gen.manual_seed(self.seed * 1_000_003 + s)
            a = torch.randn(H, r, generator=self._init_gen) * INIT_STD
            g = torch.randn(H, r, generator=self._init_gen) * INIT_STD
            bb = torch.randn(r, H, generator=self._init_gen) * INIT_STD
            self.params["A"][s].copy_(a)
            self.params["G"][s].copy_(g)
            self.params["B"][s].copy_(bb)
            self.params["b"][s].fill_(1.0)
            self.params["ln_w"][s].fill_(1.0)
            self.params["ln_b"][s].zero_()
            for state in (self.exp_avg, self.exp_avg_sq):
                for k in state:
                    state[k][s].zero_()
            self.steps[s] = 0

    # -- compute -----------------------------------------------------------------------------

    def _gather(self, layout: RowLayout) -> dict[str, torch.Tensor]:
        """The parameters of the slots present in this step: [U, ...] copies."""
        return {k: v.index_select(0, layout.active) for k, v in self.params.items()}

    def _forward(self, x: torch.Tensor, layout: RowLayout, p: dict[str, torch.Tensor]) -> torch.Tensor:
        """ŷ for rows ``x`` [R, H] (fp32) through the gathered slot parameters ``p``."""
        U, W, H = layout.active.numel(), layout.width, self.hidden
        block = x.new_zeros(U, W, H)
        block[layout.row_slot, layout.row_pos] = x
        up = torch.bmm(block, p["A"])  # [U, W, r]
        gate = F.silu(torch.bmm(block, p["G"]) + p["b"].unsqueeze(1))
        out = block + torch.bmm(up * gate, p["B"])  # [U, W, H]
        out = F.layer_norm(out, (H,), eps=LN_EPS)
        out = out * p["ln_w"].unsqueeze(1) + p["ln_b"].unsqueeze(1)
        return out[layout.row_slot, layout.row_pos]  # [R, H]

    @torch.no_grad()
    def predict(self, x: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        """ŷ [R, H] in fp32 for source rows ``x`` [R, H]."""
        return self._forward(x.float(), layout, self._gather(layout))

    @staticmethod
    def row_error(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """e [R] = mean_H (ŷ − y)²: the per-row loss and the raw novelty."""
        return (prediction.float() - target.float()).pow(2).mean(dim=-1)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        """One optimizer step on every slot in ``layout``; returns the per-slot loss [U] (before).

        The loss of a slot is the mean row error over its rows in this step. Slots are disjoint,
        so summing their losses gives each slot exactly its own gradient.
        """
        with torch.inference_mode(False), torch.enable_grad():
            # Inference tensors cannot be saved for backward: clone the taps outside that mode.
            x = x.detach().float().clone()
            y = y.detach().float().clone()
            p = {k: v.requires_grad_(True) for k, v in self._gather(layout).items()}
            err = self.row_error(self._forward(x, layout, p), y)  # [R]
            U = layout.active.numel()
            per_slot = torch.zeros(U, device=err.device).index_add(0, layout.row_slot, err)
            count = torch.zeros(U, device=err.device).index_add(
                0, layout.row_slot, torch.ones_like(err)
            )
            loss = per_slot / count
            grads = torch.autograd.grad(loss.sum(), list(p.values()))
        self._apply_update(layout.active, dict(zip(p, grads)))
        return loss.detach()

    @torch.no_grad()
    def _apply_update(self, active: torch.Tensor, grads: dict[str, torch.Tensor]) -> None:
        """Per-slot SGD or Adam on the active slots; each slot has its own step count."""
        self.steps[active] += 1
        t = self.steps[active]
        for k, p in self.params.items():
            g = grads[k]
            if self.optimizer == "sgd":
                p.index_add_(0, active, -self.lr * g)
                continue
            b1, b2 = ADAM_BETAS
            m = self.exp_avg[k].index_select(0, active).mul_(b1).add_(g, alpha=1 - b1)
            v = self.exp_avg_sq[k].index_select(0, active).mul_(b2).addcmul_(g, g, value=1 - b2)
            self.exp_avg[k].index_copy_(0, active, m)
            self.exp_avg_sq[k].index_copy_(0, active, v)
            shape = (-1,) + (1,) * (g.dim() - 1)
            bc1 = (1 - b1 ** t).reshape(shape)
            bc2 = (1 - b2 ** t).reshape(shape)
            update = (m / bc1) / ((v / bc2).sqrt() + ADAM_EPS)
            p.index_add_(0, active, -self.lr * update)
