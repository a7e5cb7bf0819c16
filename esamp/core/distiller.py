"""The Distiller bank: one small network per prompt group, trained online while the LLM decodes.

Each slot s predicts the deep tap y from the shallow tap x with a low-rank gated residual and a
LayerNorm:

    ŷ = LN(x + ((x·A) ⊙ SiLU(x·G + b))·B)        A, G ∈ R^{H×r}, B ∈ R^{r×H}, b ∈ R^r

initialised A, G, B ~ N(0, 0.02²), b = 1, LN affine (1, 0). Per row, e = mean_H (ŷ − y)² is the
loss term and the raw novelty. One optimizer step per decode step (Adam or SGD) minimises, for
every slot that trains, the mean of e over its training rows: all of the group's rows in the step
(``train_rows="all"``) or one (``"group"``). Slots never share parameters or optimizer state, and
each slot counts its own steps, so a re-initialised slot starts exactly fresh.

One slot per prompt group, shared by its n samples: the Distiller learns what the group has
already produced, so novelty is relative to the siblings. A group takes the lowest free slot when
it starts and gives it back, re-initialised, when it ends; a full bank is an error
(``BankFullError``), never a reuse of another group's slot.

A step lays its rows out as a [U, W, H] block (U slots present, W rows of the widest slot), so
every slot's products are one batched matmul and no parameter is copied per row. A and G are
stored side by side as one [H, 2r] block ``AG``: one matmul gives x·A and x·G together.
How the parameters are stored and updated (one flat buffer, a fused optimizer) is
``esamp.core.backends.flat``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from esamp.core.backends.flat import FlatParameters
from esamp.errors import BankFullError

INIT_STD = 0.02
LN_EPS = 1e-5


@dataclass(frozen=True)
class RowLayout:
    """Where each row of a step sits in the [U, W, H] slot block. Built fresh for every batch."""

    active: torch.Tensor  # [U] slot ids present in this step
    row_slot: torch.Tensor  # [R] index into ``active`` for each row
    row_pos: torch.Tensor  # [R] position of the row inside its slot's block
    width: int  # W: rows of the widest slot in this step
    slots: tuple[int, ...]  # ``active`` as host ints

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

        return cls(t(list(order)), t(row_slot), t(row_pos), max(counts, default=0), tuple(order))

    def to(self, move) -> "RowLayout":
        """The same layout with its tensors moved by ``move`` (e.g. a non-blocking device copy)."""
        return RowLayout(move(self.active), move(self.row_slot), move(self.row_pos), self.width, self.slots)


@dataclass(frozen=True)
class Training:
    """Which rows train in a step. The loss of a slot is the mean error of its training rows."""

    slots: tuple[int, ...]  # slots that take an optimizer step, in the order their losses come
    rows: torch.Tensor | None = None  # [T] the rows that train, when not every row does
    layout: RowLayout | None = None  # those rows' own layout

    @classmethod
    def of(cls, slots: list[int], trains: list[bool]) -> "Training | None":
        """From each row's slot and whether it trains (host lists, in row order); None when no
        row trains. Host tensors: move them with ``to``."""
        if not any(trains):
            return None
        if all(trains):
            return cls(tuple(dict.fromkeys(slots)))
        rows = [i for i, t in enumerate(trains) if t]
        layout = RowLayout.from_slots([slots[i] for i in rows])
        return cls(layout.slots, torch.tensor(rows, dtype=torch.long), layout)

    def to(self, move) -> "Training":
        return Training(self.slots, None if self.rows is None else move(self.rows),
                        None if self.layout is None else self.layout.to(move))


def init_slot(hidden: int, rank: int, seed: int, slot: int) -> dict[str, torch.Tensor]:
    """A slot's initial weights. They depend only on (seed, slot): a reset slot equals a new one."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + slot)
    a = torch.randn(hidden, rank, generator=gen) * INIT_STD
    g = torch.randn(hidden, rank, generator=gen) * INIT_STD
    B = torch.randn(rank, hidden, generator=gen) * INIT_STD
    return {"AG": torch.cat([a, g], dim=1), "b": torch.ones(rank), "B": B,
            "ln_w": torch.ones(hidden), "ln_b": torch.zeros(hidden)}


def forward(block: torch.Tensor, p: dict[str, torch.Tensor], rank: int) -> torch.Tensor:
    """ŷ for a [U, W, H] block of source rows through the slots' parameters ``p`` ([U, ...])."""
    both = torch.bmm(block, p["AG"])  # [U, W, 2r]: x·A | x·G
    gate = F.silu(both[..., rank:] + p["b"].unsqueeze(1))
    out = block + torch.bmm(both[..., :rank] * gate, p["B"])  # [U, W, H]
    out = F.layer_norm(out, (block.shape[-1],), eps=LN_EPS)
    return out * p["ln_w"].unsqueeze(1) + p["ln_b"].unsqueeze(1)


def row_error(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """e [R] = mean_H (ŷ − y)²: the per-row loss and the raw novelty."""
    return (prediction.float() - target.float()).pow(2).mean(dim=-1)


def bank_full(capacity: int) -> BankFullError:
    return BankFullError(f"all {capacity} Distiller slots are held by running prompt groups",
                         hint="wait for a group to finish, abort one, or start with more slots (--slots)")


class DistillerBank:
    """``slots`` Distillers of rank ``rank`` over hidden size ``hidden``, one per prompt group."""

    PARAMS = ("AG", "b", "B", "ln_w", "ln_b")  # the trained tensors, in storage order

    def __init__(self, hidden: int, rank: int = 64, slots: int = 64, lr: float = 1e-3,
                 optimizer: str = "adam", device: torch.device | str = "cpu", seed: int = 0) -> None:
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', not {optimizer!r}")
        self.hidden, self.rank, self.capacity = hidden, rank, slots
        self.lr, self.optimizer, self.seed = lr, optimizer, seed
        self.device = torch.device(device)
        H, r = hidden, rank
        shapes = {"AG": (H, 2 * r), "b": (r,), "B": (r, H), "ln_w": (H,), "ln_b": (H,)}
        self.store = FlatParameters({k: shapes[k] for k in self.PARAMS}, slots, self.device)
        self.params = dict(self.store.params)  # name → [S, ...] views, plus A and G
        self.params["A"], self.params["G"] = self.params["AG"][..., :r], self.params["AG"][..., r:]
        self._groups: dict[str, int] = {}
        self._free: list[int] = list(range(slots))  # a min-heap: the lowest free slot goes first
        for s in range(slots):
            self.store.reset(s, init_slot(H, r, seed, s))

    # -- slots -------------------------------------------------------------------------------

    @property
    def groups(self) -> dict[str, int]:
        """group key → slot, for the groups holding a slot now."""
        return dict(self._groups)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self, group: str) -> int:
        """The slot of ``group``, taking the lowest free one on first sight (so groups that start
        together hold consecutive slots, which a step reads in place)."""
        if group in self._groups:
            return self._groups[group]
        if not self._free:
            raise bank_full(self.capacity)
        slot = heapq.heappop(self._free)
        self._groups[group] = slot
        return slot

    def free(self, group: str) -> None:
        """Release ``group``'s slot and re-initialise it, so the next holder starts fresh."""
        slot = self._groups.pop(group, None)
        if slot is not None:
            self.store.reset(slot, init_slot(self.hidden, self.rank, self.seed, slot))
            heapq.heappush(self._free, slot)

    def slot_of(self, group: str) -> int:
        return self._groups[group]

    # -- compute -----------------------------------------------------------------------------

    def _forward(self, x: torch.Tensor, layout: RowLayout, p: dict[str, torch.Tensor]) -> torch.Tensor:
        """ŷ [R, H] (fp32) for rows ``x`` through the active slots' parameters ``p``."""
        block = x.new_zeros(layout.active.numel(), layout.width, self.hidden)
        block[layout.row_slot, layout.row_pos] = x
        return forward(block, p, self.rank)[layout.row_slot, layout.row_pos]

    def _active(self, layout: RowLayout) -> torch.Tensor:
        return self.store.rows(layout.slots, layout.active)

    @torch.no_grad()
    def predict(self, x: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        """ŷ [R, H] in fp32 for source rows ``x`` [R, H]."""
        return self._forward(x.float(), layout, self.store.named(self._active(layout)))

    row_error = staticmethod(row_error)

    def train_step(self, x: torch.Tensor, y: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        """One optimizer step on every slot in ``layout``; returns the per-slot loss [U] (before)."""
        return self._train(x, y, layout)[2]

    def step(self, x: torch.Tensor, y: torch.Tensor, layout: RowLayout, training: Training | None):
        """One Distiller step: (ŷ [R, H], e [R], loss of each training slot, or None).

        ŷ and e come from the parameters before this step's update (what steers this step).
        When every row trains, one forward pass serves both them and the update; when only some
        do (``train_rows="group"``), every row is predicted and only those rows are trained on.
        """
        if training is None:
            prediction = self.predict(x, layout)
            return prediction, row_error(prediction, y), None
        if training.rows is None:
            return self._train(x, y, layout)
        prediction = self.predict(x, layout)
        rows = training.rows
        loss = self._train(x.index_select(0, rows), y.index_select(0, rows), training.layout)[2]
        return prediction, row_error(prediction, y), loss

    def _train(self, x: torch.Tensor, y: torch.Tensor, layout: RowLayout):
        """One optimizer step on every slot of ``layout`` with all its rows: (ŷ, e, per-slot loss).

        Slots are disjoint, so the gradient of the summed per-slot losses gives each slot
        exactly its own gradient.
        """
        with torch.inference_mode(False), torch.enable_grad():
            # Tensors made under inference mode (vLLM's sampler, the reference engine's forward)
            # cannot take part in autograd: clone the taps and the layout outside that mode.
            x, y = x.detach().float().clone(), y.detach().float().clone()
            layout = RowLayout(*(t.clone() for t in (layout.active, layout.row_slot, layout.row_pos)),
                               layout.width, layout.slots)
            # Each parameter's [U, ...] view of the live rows is a leaf: autograd writes its
            # gradient straight into a [U, ...] tensor.
            rows = self._active(layout).detach()
            p = {k: self.store.view(rows, k).requires_grad_(True) for k in self.PARAMS}
            prediction = self._forward(x, layout, p)
            err = row_error(prediction, y)  # [R]
            U = layout.active.numel()
            total = torch.zeros(U, device=err.device).index_add(0, layout.row_slot, err)
            count = torch.zeros(U, device=err.device).index_add(0, layout.row_slot, torch.ones_like(err))
            loss = total / count
            grads = torch.autograd.grad(loss.sum(), [p[k] for k in self.PARAMS])
        self.store.update(layout.slots, dict(zip(self.PARAMS, grads)), self.optimizer, self.lr)
        return prediction.detach(), err.detach(), loss.detach()
