"""The Distiller bank: one small network per prompt group, trained online while the LLM decodes.

Each slot s predicts the deep tap y from the shallow tap x with a low-rank gated residual and a
LayerNorm:

    ŷ = LN(x + ((x·A) ⊙ SiLU(x·G + b))·B)        A, G ∈ R^{H×r}, B ∈ R^{r×H}, b ∈ R^r

initialised A, G, B ~ N(0, 0.02²), b = 1, LN affine (1, 0). Per row, e = mean_H (ŷ − y)² is the
loss term and the raw novelty. One optimizer step per decode step (Adam or SGD) minimises, for
every slot that trains, the mean of e over its training rows: all of the group's rows in the step
(``train_rows="all"``) or one (``"group"``). Slots never share parameters or optimizer state, and
each slot counts its own steps, so a re-initialised slot starts exactly fresh.

Two ways to give groups their Distillers (``EsampConfig.distiller``):

- ``bank`` (the default): one slot per prompt group, shared by its n samples: the Distiller
  learns what the group has already produced, so novelty is relative to the siblings. A group
  takes the lowest free slot when it starts and gives it back, re-initialised, when it ends.
- ``shared`` (the published runtime's default): the bank stores one Distiller, slot 0, and every
  group holds it: every steered row of every group uses and trains it, its loss is the mean over
  all the step's training rows, and it is never re-initialised while the engine runs, so it
  keeps learning across groups and novelty is relative to everything the engine has decoded.
  A step's rows then form one unit of the block below.

In both, at most ``slots`` groups are steered at once; one more is an error (``BankFullError``),
never a reuse of another group's slot.

A step lays its rows out as a [U, W, H] block (U slots present, W rows of the widest slot), so
every slot's products are one batched matmul. The block may be padded past what its rows need:
the slots and rows are device tensors of the layout, so a step of one (U, W) shape is the same
sequence of kernels whichever groups hold which slots (what lets a captured CUDA graph serve every
batch of that shape). A and G are stored side by side as one [H, 2r] block ``AG``: one matmul
gives x·A and x·G together. How the parameters are stored and updated (one flat buffer with a
scratch slot for padding, one optimizer kernel) is ``esamp.core.backends.flat``.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from esamp.core.backends import streams, triton_distiller as kernels
from esamp.core.backends.flat import FlatParameters
from esamp.errors import BankFullError

if TYPE_CHECKING:
    from esamp.core.config import EsampConfig

INIT_STD = 0.02
LN_EPS = 1e-5


def block_shape(slots: list[int]) -> tuple[int, int]:
    """[U, W] of the tightest block for rows of these slots: the distinct slots, the most rows of one."""
    counts: dict[int, int] = {}
    for s in slots:
        counts[s] = counts.get(s, 0) + 1
    return len(counts), max(counts.values(), default=1)


@dataclass(frozen=True)
class HostLayout:
    """A ``RowLayout``'s fields as host lists (what a plan writes into its fixed buffers)."""

    units: list[int]
    gather: list[int]
    cell: list[int]
    weight: list[float]
    row_of: list[int]
    width: int
    zero_row: int
    slots: tuple[int, ...]
    training: tuple[int, ...]

    @classmethod
    def of(
        cls,
        slots: list[int],
        trains: list[bool] | None = None,
        *,
        units: int | None = None,
        width: int | None = None,
        scratch: int = -1,
        zero_row: int | None = None,
        sources: list[int] | None = None,
    ) -> HostLayout:
        """``RowLayout.from_slots``'s layout of ``slots``, on the host (its docstring says what each
        argument does)."""
        order: dict[int, int] = {}
        cells: list[list[int]] = []
        for row, s in enumerate(slots):
            u = order.setdefault(s, len(order))
            if u == len(cells):
                cells.append([])
            cells[u].append(row)
        need_u, need_w = len(cells), max((len(c) for c in cells), default=1)
        U = need_u if units is None else units
        W = need_w if width is None else width
        if U < need_u or W < need_w:
            raise ValueError(f"a [{U}, {W}] block cannot hold {need_u} slots of up to {need_w} rows")
        if U > need_u and scratch < 0:
            raise ValueError("padding units needs the bank's scratch slot")
        zero = len(slots) if zero_row is None else zero_row
        trains = [True] * len(slots) if trains is None else list(trains)
        gather = [zero] * (U * W)
        weight = [0.0] * (U * W)
        row_of = [-1] * (U * W)
        cell = [0] * len(slots)
        for u, rows in enumerate(cells):
            for w, row in enumerate(rows):
                gather[u * W + w] = row if sources is None else sources[row]
                weight[u * W + w] = 1.0 if trains[row] else 0.0
                cell[row] = u * W + w
                row_of[u * W + w] = row
        training = tuple(u for u, rows in enumerate(cells) if any(trains[r] for r in rows))
        slot_list = list(order)
        units_list = slot_list + [scratch] * (U - need_u)
        return cls(units_list, gather, cell, weight, row_of, W, zero, tuple(slot_list), training)


@dataclass(frozen=True)
class RowLayout:
    """Where each row of a step sits in the [U, W, H] slot block. Built when the batch changes.

    Block row u holds the rows of slot ``units[u]``; cell (u, w) reads input row ``gather[u·W + w]``.
    A layout may be padded to a larger shape than its rows need (fixed shapes let one captured step
    serve many batches): padded units name the bank's scratch slot and padded cells read the zero
    row, which the step supplies, and neither trains.
    """

    units: torch.Tensor  # [U] slot of each block row (padding: the scratch slot)
    gather: torch.Tensor  # [U·W] input row of each cell (padding: ``zero_row``)
    cell: torch.Tensor  # [R] the cell of each row
    weight: torch.Tensor  # [U·W] fp32, 1 where the cell's row trains this step
    row_of: torch.Tensor  # [U·W] the row of each cell, the inverse of ``cell`` (padding: −1)
    rows: int  # R, the rows laid out
    width: int  # W
    zero_row: int  # the input row index that reads as zeros
    slots: tuple[int, ...]  # the real slots, in unit order (host ints)
    training: tuple[int, ...]  # the units that take an optimizer step, in unit order

    @property
    def shape(self) -> tuple[int, int]:
        return self.units.numel(), self.width

    @classmethod
    def from_slots(
        cls, slots: list[int], trains: list[bool] | None = None, *, device: torch.device | str = "cpu", **padding
    ) -> RowLayout:
        """The layout of rows whose slots are ``slots`` (host ints, in row order); ``trains``
        (default: every row) says which rows the optimizer step learns from. ``padding``:
        ``HostLayout.of``'s ``units`` and ``width`` (pad the block; ``scratch``: the bank's scratch
        slot), ``zero_row`` (default: the row after the last; the step appends a zero row) and
        ``sources`` (where each row is in the input the step reads; default: row i is input row i)."""
        host = HostLayout.of(slots, trains, **padding)

        def t(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            t(host.units),
            t(host.gather),
            t(host.cell),
            t(host.weight, torch.float32),
            t(host.row_of),
            len(slots),
            host.width,
            host.zero_row,
            host.slots,
            host.training,
        )

    def to(self, move) -> RowLayout:
        """The same layout with its tensors moved by ``move`` (e.g. a non-blocking device copy)."""
        return dataclasses.replace(
            self,
            units=move(self.units),
            gather=move(self.gather),
            cell=move(self.cell),
            weight=move(self.weight),
            row_of=move(self.row_of),
        )


def init_slot(hidden: int, rank: int, seed: int, slot: int) -> dict[str, torch.Tensor]:
    """A slot's initial weights. They depend only on (seed, slot): a reset slot equals a new one."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + slot)
    a = torch.randn(hidden, rank, generator=gen) * INIT_STD
    g = torch.randn(hidden, rank, generator=gen) * INIT_STD
    B = torch.randn(rank, hidden, generator=gen) * INIT_STD
    return {
        "AG": torch.cat([a, g], dim=1),
        "b": torch.ones(rank),
        "B": B,
        "ln_w": torch.ones(hidden),
        "ln_b": torch.zeros(hidden),
    }


SPLIT_PIECE = 384  # the shortest piece of H one product of ``forward``'s split x·[A|G] sums over


def split_for(hidden: int, device: torch.device | str) -> int:
    """How many pieces ``forward`` cuts H into for x·[A|G] on ``device``.

    x·[A|G] is U products of [W, H]·[H, 2r]: few rows and a long sum. On a GPU, cuBLAS gives each
    product a few thread blocks that walk all of H in turn (115 of the fair workload's 405 µs of
    ESamp kernel time at 7B, ``benchmarks/results/steps-7b-fair-9aef8c3-h100``); cut into k pieces
    the same work is U·k products of H/k and one sum over k. A CPU's BLAS splits long sums itself:
    1 there."""
    if torch.device(device).type != "cuda":
        return 1
    for k in (16, 8, 4, 2):
        if hidden % k == 0 and hidden // k >= SPLIT_PIECE:
            return k
    return 1


def forward(block: torch.Tensor, p: dict[str, torch.Tensor], rank: int, split: int = 1) -> torch.Tensor:
    """ŷ for a [U, W, H] block of source rows through the slots' parameters ``p`` ([U, ...]);
    ``split`` (dividing H): x·[A|G] summed over that many pieces of H (``split_for``)."""
    if split == 1:
        both = torch.bmm(block, p["AG"])  # [U, W, 2r]: x·A | x·G
    else:
        U, W, H = block.shape
        h = H // split
        pieces = block.view(U, W, split, h).transpose(1, 2).reshape(U * split, W, h)
        # [U, H, 2r] → [U·k, H/k, 2r]: a view where AG is contiguous (``DistillerBank`` gathers it so)
        both = torch.bmm(pieces, p["AG"].reshape(U * split, h, 2 * rank)).view(U, split, W, 2 * rank).sum(dim=1)
    gate = F.silu(both[..., rank:] + p["b"].unsqueeze(1))
    out = block + torch.bmm(both[..., :rank] * gate, p["B"])  # [U, W, H]
    out = F.layer_norm(out, (block.shape[-1],), eps=LN_EPS)
    return out * p["ln_w"].unsqueeze(1) + p["ln_b"].unsqueeze(1)


def row_error(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """e [R] = mean_H (ŷ − y)²: the per-row loss and the raw novelty."""
    return (prediction.float() - target.float()).pow(2).mean(dim=-1)


@dataclass(frozen=True)
class TapNorm:
    """An RMSNorm a tap passes through before the Distiller reads it, computed in fp32:
    x / √(mean x² + eps) · (offset + weight). Llama's and Qwen2's input norms have offset 0,
    Gemma's 1 (its weights are stored minus one)."""

    weight: torch.Tensor  # [H]
    eps: float
    offset: float = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (self.offset + self.weight.float())


@dataclass(frozen=True)
class TapNorms:
    """The two taps' norms as one ``normalize(x, y) -> (x, y)``, in a form the fused kernels read."""

    source: TapNorm
    target: TapNorm

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.source(x), self.target(y)


class Update(NamedTuple):
    """A step's second half (``DistillerBank.learn``), ready to run as ``run(*reads)``; ``reads``
    are the tensors of the step it reads (a graph's key and a side stream's bookkeeping)."""

    run: Callable[..., None]
    reads: tuple[torch.Tensor, ...]


BACKENDS = ("auto", "torch", "fused")  # ESAMP_DISTILLER: how a bank computes its step (``DistillerBank``)

SHARED_SLOT = 0  # the slot of the shared Distiller, which every group holds


def bank_full(capacity: int, shared: bool = False) -> BankFullError:
    hint = "wait for a group to finish, abort one, or start with more slots (--slots)"
    if shared:
        return BankFullError(
            f"the shared Distiller already steers {capacity} prompt groups, as many as --slots allows", hint=hint
        )
    return BankFullError(f"all {capacity} Distiller slots are held by running prompt groups", hint=hint)


class SlotLedger:
    """Which group holds which slot, for up to ``capacity`` groups at once.

    A bank (``shared`` False) has ``capacity`` slots and the lowest free one goes to a new group.
    A shared Distiller (``shared`` True) is one slot, ``SHARED_SLOT``, that every group holds; a
    group's end frees its place, not the slot's weights.

    The bookkeeping of a ``DistillerBank`` without its tensors. A tensor-parallel worker that
    holds no bank keeps one of these, so that its slot assignment, and with it every plan it builds,
    is the one of the worker that owns the bank (``esamp.engines.vllm.steering``)."""

    def __init__(self, capacity: int, shared: bool = False) -> None:
        self.capacity = capacity
        self.shared = shared
        self.distillers = 1 if shared else capacity  # Distillers stored: one per slot, or the shared one
        self.scratch = self.distillers  # the padding slot of fixed-shape steps (never a group's)
        self._groups: dict[str, int] = {}
        self._free: list[int] = [] if shared else list(range(capacity))  # a min-heap

    @property
    def groups(self) -> dict[str, int]:
        """group key → slot, for the groups holding a slot now."""
        return dict(self._groups)

    @property
    def free_slots(self) -> int:
        """How many more groups may be steered now."""
        return self.capacity - len(self._groups)

    def allocate(self, group: str) -> int:
        """The slot of ``group``, taking the lowest free one (or the shared one) on first sight."""
        if group in self._groups:
            return self._groups[group]
        if len(self._groups) >= self.capacity:
            raise bank_full(self.capacity, self.shared)
        slot = SHARED_SLOT if self.shared else heapq.heappop(self._free)
        self._groups[group] = slot
        return slot

    def free(self, group: str) -> int | None:
        """Release ``group``'s slot; the slot it held, or None."""
        slot = self._groups.pop(group, None)
        if slot is not None and not self.shared:
            heapq.heappush(self._free, slot)
        return slot


class DistillerBank(SlotLedger):
    """Distillers of rank ``rank`` over hidden size ``hidden``: ``slots`` of them, one per prompt
    group, or (``shared``) one that every group uses, for up to ``slots`` groups at once."""

    PARAMS = ("AG", "b", "B", "ln_w", "ln_b")  # the trained tensors, in storage order

    def __init__(
        self,
        hidden: int,
        rank: int = 64,
        slots: int = 64,
        lr: float = 1e-3,
        optimizer: str = "adam",
        device: torch.device | str = "cpu",
        seed: int = 0,
        shared: bool = False,
        split: int | None = None,
        backend: str | None = None,
    ) -> None:
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', not {optimizer!r}")
        backend = backend or os.environ.get("ESAMP_DISTILLER", "auto")
        if backend not in BACKENDS:
            raise ValueError(f"ESAMP_DISTILLER must be one of {', '.join(BACKENDS)}, not {backend!r}")
        self.backend = backend
        super().__init__(slots, shared)
        self.hidden, self.rank = hidden, rank
        self.lr, self.optimizer, self.seed = lr, optimizer, seed
        self.device = torch.device(device)
        self.split = split_for(hidden, self.device) if split is None else split
        if hidden % self.split:
            raise ValueError(f"split {self.split} does not divide the hidden size {hidden}")
        H, r = hidden, rank
        shapes = {"AG": (H, 2 * r), "b": (r,), "B": (r, H), "ln_w": (H,), "ln_b": (H,)}
        self._store = FlatParameters({k: shapes[k] for k in self.PARAMS}, self.distillers, self.device)
        assert self._store.scratch == self.scratch
        self.params = dict(self._store.params)  # name → [S + 1, ...] views, plus A and G
        self.params["A"], self.params["G"] = self.params["AG"][..., :r], self.params["AG"][..., r:]
        # + the scratch slot. The shared Distiller starts as a bank's slot 0 does.
        self._store.initialise([init_slot(H, r, seed, s) for s in range(self.distillers + 1)])
        self._updating = None  # CUDA event of an update still running beside the current stream
        self._cuda_index: int | None = None  # the CUDA device's index (at the first update beside)
        self._workspace: kernels.Workspace | None = None  # the fused kernels' buffers
        self.precision: str | None = None  # the fused kernels' products (None: ``kernels.PRECISION``)
        self._reserved = (0, 0)  # rows and cells the workspace is made for at least (``reserve``)

    @property
    def store(self) -> FlatParameters:
        """The parameters and optimizer state, once any update in flight has landed (``settle``)."""
        self.settle()
        return self._store

    def updating(self, event) -> None:
        """An update (``learn``) runs beside the current stream until ``event``: whatever next
        reads or writes the parameters waits for it (``settle``)."""
        self._updating = event

    def settle(self) -> None:
        """Order the current stream after the update in flight, if any."""
        if self._updating is not None:
            if self._cuda_index is None:
                self._cuda_index = streams.index_of(self.device)
            streams.wait(streams.current(self._cuda_index), self._updating)
            self._updating = None

    def free(self, group: str) -> int | None:
        """Release ``group``'s slot. A bank's slot is re-initialised, so the next holder starts
        fresh; the shared Distiller keeps what it learnt."""
        slot = self._groups.get(group)
        if slot is not None and not self.shared:
            self.store.reset(slot)  # (after the update in flight)
        return super().free(group)

    # -- compute -----------------------------------------------------------------------------

    def _blocks(self, x: torch.Tensor, layout: RowLayout, normalize=None):
        """The [U·W, H] source block of ``x`` (rows, plus the zero row when ``x`` lacks it)."""
        if x.shape[0] == layout.zero_row:
            x = F.pad(x, (0, 0, 0, 1))
        return x.index_select(0, layout.gather)

    def _forward(self, block: torch.Tensor, shape: tuple[int, int], p: dict[str, torch.Tensor]) -> torch.Tensor:
        U, W = shape
        return forward(block.view(U, W, self.hidden), p, self.rank, self.split).view(U * W, self.hidden)

    @torch.no_grad()
    def predict(self, x: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        """ŷ [R, H] in fp32 for source rows ``x`` [R, H]."""
        block = self._blocks(x, layout).float()
        return self._forward(block, layout.shape, self.store.gather(layout.units)).index_select(0, layout.cell)

    row_error = staticmethod(row_error)

    def step(self, x: torch.Tensor, y: torch.Tensor, layout: RowLayout, normalize=None):
        """One Distiller step: (ŷ [R, H] fp32, e [R], loss [U] per unit or None).

        ŷ and e come from the parameters before this step's update (what steers this step). The
        units in ``layout.training`` take one optimizer step on the mean error of their training
        rows (the loss of the other units is 0). ``normalize(x, y) -> (x, y)`` turns the raw taps
        into the Distiller's inputs, applied to the gathered rows (a zero row stays zero under a
        norm). It is ``evaluate`` then the update it returns, which an engine may run apart: the
        update beside the next work (``Steerer``), as long as nothing reads the parameters before
        it lands.
        """
        prediction, err, loss, update = self.evaluate(x, y, layout, normalize)
        if update is not None:
            update.run(*update.reads)
        return prediction, err, loss

    # -- how the step is computed --------------------------------------------------------------

    def reserve(self, rows: int, cells: int) -> None:
        """Size the fused kernels' workspace for steps of up to ``rows`` rows in blocks of up to
        ``cells`` cells before the first one (an engine whose steps are captured as CUDA graphs
        must never see it grow)."""
        self._reserved = (max(rows, self._reserved[0]), max(cells, self._reserved[1]))

    def fused(self, x: torch.Tensor, y: torch.Tensor, normalize) -> bool:
        """Whether this step runs as the fused kernels (``backends.triton_distiller``): on a GPU
        with Triton unless ``backend`` is "torch" (ESAMP_DISTILLER=torch), always with "fused"
        (Triton's interpreter on the CPU, for tests); the taps' norms must be ``TapNorms`` (or
        none) and the rank at most ``MAX_RANK``. Elsewhere the PyTorch path, the reference."""
        if self.backend == "torch" or not (normalize is None or isinstance(normalize, TapNorms)):
            return False
        if self.backend == "fused":
            return kernels.triton is not None and self.rank <= kernels.MAX_RANK
        return kernels.usable(self.rank, x, y, self._store.flat)

    def outputs(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where the fused step leaves what ``evaluate`` returns views of, whole and at fixed
        addresses: ŷ [rows, H] in ``dtype``, e [rows] and the units' losses [cells] (a reader
        captured once serves every later step, whatever its block). None before the first fused
        step in ``dtype`` (and on the PyTorch path, whose outputs are new tensors every step)."""
        ws = self._workspace
        if ws is None or not ws.has_output(dtype):
            return None
        return ws.output(dtype), ws.errors, ws.losses

    def _workspace_for(self, layout: RowLayout, tap_dtype: torch.dtype) -> kernels.Workspace:
        rows = max(layout.rows + 1, self._reserved[0])
        cells = max(layout.units.numel() * layout.width, self._reserved[1])
        ws = self._workspace
        if ws is None or not ws.fits(rows, cells, self.hidden, self.rank, tap_dtype):
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"the Distiller's workspace must grow to {rows} rows and {cells} cells while a CUDA graph "
                    "is captured; reserve() it for the engine's largest step first"
                )
            if ws is not None:
                rows, cells = max(rows, ws.rows), max(cells, ws.cells)
            with torch.inference_mode(False):
                ws = kernels.Workspace(rows, cells, self.hidden, self.rank, tap_dtype, self.device)
            self._workspace = ws
        return ws

    def evaluate(self, x: torch.Tensor, y: torch.Tensor, layout: RowLayout, normalize=None, out_dtype=None):
        """A step's first half: (ŷ [R, H] in ``out_dtype`` (fp32 by default), e [R], loss [U] or
        None, update) from the parameters as they are. ``update`` (None when no unit trains) is
        the second half, to run before anything else reads or writes the parameters: it reads
        only tensors of this call's own (the plan's may change before it runs). A fixed sequence
        of kernels for a given layout shape, as the update is: each can be captured as a CUDA
        graph and replayed for any layout of that shape. The fused path's outputs live in the
        bank's workspace: read them before the next step, as a graph's outputs."""
        self.settle()
        if self.fused(x, y, normalize):
            ws = self._workspace_for(layout, x.dtype)
            store, shape, precision = self._store, layout.shape, self.precision
            prediction, err, loss = kernels.evaluate(
                ws, store, store.spans, x, y, layout, normalize, out_dtype or torch.float32, LN_EPS, self.precision
            )
            if not layout.training:
                return prediction, err, None, None

            def learn(*_):
                kernels.learn(ws, store, store.spans, shape, normalize, self.optimizer, self.lr, precision)

            return prediction, err, loss, Update(learn, (ws.h,))
        bx, by = self._blocks(x, layout), self._blocks(y, layout)
        if normalize is not None:
            bx, by = normalize(bx, by)
        bx, by = bx.float(), by.float()
        with torch.no_grad():
            prediction = self._forward(bx, layout.shape, self._store.gather(layout.units))
            err = row_error(prediction, by)
        loss = update = None
        if layout.training:
            loss = _unit_loss(err, layout.weight, layout.shape)
            update = Update(self.learn, (bx, by, layout.units.clone(), layout.weight.clone().view(layout.shape)))
        prediction = prediction.index_select(0, layout.cell)
        if out_dtype is not None:
            prediction = prediction.to(out_dtype)
        return prediction, err.index_select(0, layout.cell), loss, update

    def learn(self, bx: torch.Tensor, by: torch.Tensor, units: torch.Tensor, weight: torch.Tensor) -> None:
        """The PyTorch path's second half: one optimizer step for every unit whose ``weight`` row
        ([U, W]) has a training cell, on the mean error of those cells, from ``evaluate``'s
        gathered blocks (the parameters must be the ones ``evaluate`` read)."""
        with torch.inference_mode(False), torch.enable_grad():
            # Tensors made under inference mode (vLLM's sampler, the reference engine's forward)
            # cannot be saved for backward: the blocks and the weights are fresh copies. Each
            # parameter's gathered [U, ...] copy is a leaf: autograd writes its gradient straight
            # into a [U, ...] tensor.
            bx, by, weight = bx.clone(), by.clone(), weight.clone()
            p = {k: t.requires_grad_(True) for k, t in self._store.gather(units).items()}
            err = row_error(self._forward(bx, weight.shape, p), by)
            loss = _unit_loss(err, weight, weight.shape)
            grads = torch.autograd.grad(loss.sum(), [p[k] for k in self.PARAMS])
        grads = {k: g.contiguous() for k, g in zip(self.PARAMS, grads)}
        self._store.update(units, weight.sum(dim=1), grads, self.optimizer, self.lr)


def _unit_loss(err: torch.Tensor, weight: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Per unit of a [U, W] block, the mean error [U] of its training cells (0 where none)."""
    weight = weight.view(shape)
    return (err.view(shape) * weight).sum(dim=1) / weight.sum(dim=1).clamp(min=1.0)


def bank_for(
    config: EsampConfig, hidden: int, device: torch.device | str = "cpu", backend: str | None = None
) -> DistillerBank:
    """The Distiller bank of an engine with these settings, over hidden size ``hidden``
    (``backend``: ``DistillerBank``'s)."""
    return DistillerBank(
        hidden,
        rank=config.rank,
        slots=config.slots,
        lr=config.lr,
        optimizer=config.optimizer,
        device=device,
        seed=config.seed,
        shared=config.shared_distiller,
        backend=backend,
    )


def ledger_for(config: EsampConfig) -> SlotLedger:
    """The slot bookkeeping of ``bank_for(config, ...)`` without its tensors (a tensor-parallel
    worker that holds no bank)."""
    return SlotLedger(config.slots, config.shared_distiller)
