"""The candidate set C exactly as vLLM's own sampler forms it, so that β = 0 is plain vLLM.

vLLM (V1 sampler, 0.20 through 0.30, PyTorch path) filters the temperature-scaled logits in this
order: min-p (keep p ≥ min_p · p_max), then top-k (keep logits ≥ the k-th largest), then top-p on
what is left, renormalised: sorted ascending, a token is dropped while the cumulative mass up to
and including it is ≤ 1 − top_p; the most likely token always stays.

``esamp.intervention.candidate_mask`` applies the three filters side by side on the unfiltered
distribution instead. The two agree when one filter is active; with min-p and top-p together
they can differ (top-p over the min-p survivors keeps fewer tokens), and the cumulative sums run
in opposite directions, so a token sitting exactly on the top-p boundary can fall either way.
The vLLM engine uses this mask so that "ESamp on with β = 0" samples exactly what vLLM samples
with ESamp off; the mix on C is the core's (``esamp.intervention.steer``).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def sampler_candidate_mask(
    scaled: torch.Tensor,  # [R, V] z / T, fp32
    top_k: torch.Tensor,  # [R] int, 0 = off
    top_p: torch.Tensor,  # [R] float, 1 = off
    min_p: torch.Tensor,  # [R] float, 0 = off
) -> torch.Tensor:
    """Boolean [R, V]: the tokens vLLM's sampler would keep for these rows."""
    R, V = scaled.shape
    dev = scaled.device
    z = scaled.float()
    probs = z.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.to(dev, torch.float32).reshape(-1, 1)
    z = z.masked_fill(probs < floor, NEG_INF)

    ascending, order = z.sort(dim=-1)
    k = top_k.to(dev, torch.long).reshape(-1, 1)
    k = torch.where(k > 0, k, torch.full_like(k, V)).clamp(1, V)
    kth_largest = ascending.gather(1, V - k)
    ascending = ascending.masked_fill(ascending < kth_largest, NEG_INF)

    p = top_p.to(dev, torch.float32).reshape(-1, 1)
    mass = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = (mass <= 1 - p) & (p < 1)
    drop[:, -1] = False  # the most likely token always survives
    keep_sorted = ~drop & torch.isfinite(ascending)
    keep_sorted[:, -1] = True
    mask = torch.zeros_like(keep_sorted)
    mask.scatter_(1, order, keep_sorted)
    return mask
