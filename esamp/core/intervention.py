"""The sampler intervention, as pure tensor functions: the reference every engine is held to.

Per row: z̃ = z / T.  C = the tokens kept by the request's own min-p, top-k and top-p on z̃ (in
vLLM's sampler order), the argmax always kept.  For c in C

    z'_c = a·z̃_c − b·d_c        (a, b) from the row's mix and β (``esamp.core.mixes``)

and z'_c = −∞ outside C, where d = W_lm·ŷ are the Distiller logits (the LM head applied to the
Distiller's prediction, no final norm, no temperature). With β = 0, (a, b) = (1, 0) and z' is z̃
on C bit for bit, so sampling equals plain sampling. Rows of an entropy-matched mix then take
``match_entropy``: z' scaled by the λ that gives it plain sampling's entropy over C.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from esamp.core import mixes

NEG_INF = float("-inf")


def scale_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """z / T per row, in fp32. Rows with T == 0 (greedy) are left unscaled."""
    t = temperature.to(device=logits.device, dtype=torch.float32).reshape(-1, 1)
    t = torch.where(t > 0, t, torch.ones_like(t))
    return logits.float() / t


def candidate_mask(
    scaled: torch.Tensor,  # [R, V] z / T
    top_k: torch.Tensor,  # [R] int, 0 = off
    top_p: torch.Tensor,  # [R] float, 1 = off
    min_p: torch.Tensor,  # [R] float, 0 = off
    width: int | None = None,
) -> torch.Tensor:
    """Boolean [R, V]: the tokens the request's own filters keep, in vLLM's sampler order.

    1. min-p keeps p_c >= min_p · p_max (as z_c >= max z + log min_p);
    2. top-k keeps the k largest of those;
    3. top-p runs on what is left, renormalised: in ascending order a token is dropped while the
       cumulative mass up to and including it is <= 1 − top_p.
    The argmax always stays. Matching vLLM's order exactly is what makes β = 0 on the vLLM engine
    sample what vLLM samples with ESamp off.

    Every filter keeps a prefix of the sorted distribution, so only the ``width`` largest tokens
    are sorted: by default the widest row's bound from min-p and top-k (one host read of a
    scalar), or ``width`` when the caller knows a bound (``V`` sorts everything, no host read).
    """
    R, V = scaled.shape
    device = scaled.device
    z = scaled.float()
    # min-p in logit space: p_c >= min_p · p_max  ⇔  z_c >= max z + log(min_p), no softmax
    floor = z.amax(dim=-1, keepdim=True) + min_p.to(device, torch.float32).reshape(-1, 1).log()
    k = top_k.to(device, torch.long).reshape(-1, 1)
    k = torch.where(k > 0, k, torch.full_like(k, V))
    if width is None:
        bound = torch.minimum((z >= floor).sum(dim=-1, keepdim=True), k)
        width = int(bound.max().item()) if R else 1
    width = max(1, min(width, V))
    top_z, top_ids = z.topk(width, dim=-1)  # [R, W], descending
    rank = torch.arange(width, device=device).expand(R, width)
    kept = (top_z >= floor) & (rank < k)  # min-p, then top-k among the survivors
    # top-p over the survivors, renormalised, summed from the least likely up (as vLLM does)
    survivors = top_z.masked_fill(~kept, NEG_INF).softmax(dim=-1)
    from_bottom = survivors.flip(-1).cumsum(dim=-1).flip(-1)  # mass of this token and all below
    p = top_p.to(device, torch.float32).reshape(-1, 1)
    kept &= ~((from_bottom <= 1 - p) & (p < 1))
    kept[:, 0] = True  # the argmax survives every filter
    mask = torch.zeros(R, V, dtype=torch.bool, device=device)
    mask.scatter_(1, top_ids, kept)
    return mask


def candidate_ids(
    mask: torch.Tensor, scaled: torch.Tensor, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad each row's candidates to the widest row: ids [R, K] and validity [R, K].

    K = max |C| over the rows: one host read of a scalar (candidate sets are small under min-p),
    skipped when the caller already read it and passes it as ``width``.
    """
    if width is None:
        width = int(mask.sum(dim=-1).max().item()) if mask.numel() else 0
    width = max(width, 1)
    masked = scaled.masked_fill(~mask, NEG_INF)
    ids = masked.topk(width, dim=-1).indices
    valid = mask.gather(1, ids)
    return ids, valid


def distiller_logits_at(
    prediction: torch.Tensor,  # [R, H] Distiller output ŷ
    lm_head: torch.Tensor,  # [V, H] LM head weight
    ids: torch.Tensor,  # [R, K] token ids
    bias: torch.Tensor | None = None,  # [V]
) -> torch.Tensor:
    """d at the given ids only: [R, K] = <ŷ_r, W[ids[r, k]]> (+ b), never a [R, V] product."""
    rows = lm_head[ids]  # [R, K, H]
    d = torch.einsum("rh,rkh->rk", prediction.to(rows.dtype), rows).float()
    if bias is not None:
        d = d + bias[ids].float()
    return d


@dataclass(frozen=True)
class HeadProduct:
    """The Distiller logits d = W·ŷ kept as their two factors: ŷ [M, H] (``prediction``) and the LM
    head's dense weight W [V', H] (``head``; V' ≥ V, rows past the vocabulary are never read).

    The fused filter computes d only at each mixed row's candidates (a few tokens under min-p, not
    the V of a full product: ``backends.triton_filter``); every other path takes ``dense``, the
    product the LM head itself would give."""

    prediction: torch.Tensor
    head: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """[M, V'] of the dense product (M: the mixed rows)."""
        return (self.prediction.shape[0], self.head.shape[0])

    def dense(self, vocab: int) -> torch.Tensor:
        """d [M, vocab] in the head's dtype."""
        return self.prediction.to(self.head.dtype) @ self.head[:vocab].t()


def dense_logits(d: torch.Tensor | HeadProduct | None, vocab: int) -> torch.Tensor | None:
    """``d`` as a [M, vocab] tensor (a ``HeadProduct`` multiplied out; a tensor or None as given)."""
    return d.dense(vocab) if isinstance(d, HeadProduct) else d


def mix_coefficients(rows: Sequence[tuple[str, float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) as [R, 1] fp32 tensors for rows given as (mix name, β)."""
    ab = [mixes.coefficients(kind, beta) for kind, beta in rows]
    t = torch.tensor(ab, dtype=torch.float32).reshape(-1, 2)
    return t[:, :1].contiguous(), t[:, 1:].contiguous()


def entropy_matched(rows: Sequence[tuple[str, float]]) -> list[bool]:
    """For rows given as (mix name, β): whether each row's mix matches plain sampling's entropy."""
    return [mixes.matches_entropy(kind) for kind, _ in rows]


def mixed(scaled_at: torch.Tensor, distiller_at: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """z' = a·z̃ − b·d, elementwise; ``a``, ``b`` broadcast per row ([R, 1])."""
    return a * scaled_at - b * distiller_at


def candidate_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [R] (nats) of softmax over each row's finite entries (−∞: not a candidate)."""
    logp = logits.log_softmax(dim=-1)
    return -torch.where(torch.isfinite(logp), logp.exp() * logp, torch.zeros_like(logp)).sum(dim=-1)


# λ is found by bisection on log2 λ in [−SPAN, SPAN]: STEPS halvings leave it within 2·SPAN/2^STEPS
# of itself in log2, a relative error of about 4e-11, in a fixed sequence of kernels (no host read).
ENTROPY_SPAN = 20.0
ENTROPY_STEPS = 40


def match_entropy(
    mixed_at: torch.Tensor, scaled_at: torch.Tensor, novelty_at: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row of ``mixed_at`` (z', [R, K], −∞ outside C) scaled by the λ > 0 that gives
    softmax(λ·z') over C the entropy of softmax(z̃) over C (``scaled_at``, −∞ outside C): the mix
    may move mass between candidates but not sharpen or flatten them as a temperature would.

    Rows whose novelty term ``novelty_at`` (b·d) is the same at every candidate (β = 0, a Distiller
    that does not tell the candidates apart, a single candidate) come back as ``scaled_at``, bit
    for bit: plain sampling. Rows not in ``rows`` ([R] or [R, 1] bool, default all) come back as
    ``mixed_at``. Where no λ in [2^−SPAN, 2^SPAN] reaches the entropy (z' has tied maxima) the
    nearest end is taken.
    """
    finite = torch.isfinite(scaled_at)
    reference = novelty_at.gather(1, scaled_at.argmax(dim=-1, keepdim=True))  # at a candidate
    informative = ((novelty_at != reference) & finite).any(dim=-1, keepdim=True)
    target = candidate_entropy(scaled_at).unsqueeze(1)
    low = torch.full_like(target, -ENTROPY_SPAN)
    high = torch.full_like(target, ENTROPY_SPAN)
    for _ in range(ENTROPY_STEPS):  # entropy falls as λ grows: too flat → a larger λ
        mid = 0.5 * (low + high)
        flatter = candidate_entropy(mixed_at * torch.exp2(mid)).unsqueeze(1) > target
        low, high = torch.where(flatter, mid, low), torch.where(flatter, high, mid)
    rescaled = mixed_at * torch.exp2(0.5 * (low + high))
    out = torch.where(informative, rescaled, scaled_at)
    return out if rows is None else torch.where(rows.reshape(-1, 1).to(out.device), out, mixed_at)


def match_entropy_rows(
    mixed: torch.Tensor,
    scaled: torch.Tensor,
    novelty: torch.Tensor,
    rows: torch.Tensor | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """``match_entropy`` of whole rows ([R, V], −∞ outside C), computed at each row's candidates:
    the bisection's forty passes then read [R, K] (K: the widest row's |C|) instead of the whole
    vocabulary, which at Gemma's 262k tokens and a few hundred rows is most of a step. ``width``:
    K when known; otherwise one host read of it. Returns [R, V]: the matched rows' z' rescaled (or
    z̃ where the novelty is uninformative), the others' ``mixed``, −∞ outside C."""
    ids, valid = candidate_ids(torch.isfinite(scaled), scaled, width)
    mixed_at = mixed.gather(1, ids).masked_fill(~valid, NEG_INF)
    scaled_at = scaled.gather(1, ids).masked_fill(~valid, NEG_INF)
    matched_at = match_entropy(mixed_at, scaled_at, novelty.gather(1, ids), rows)
    out = torch.full_like(mixed, NEG_INF)
    # Scatter valid entries only: padded ids may repeat a real candidate's id.
    out.scatter_(1, torch.where(valid, ids, ids[:, :1]), torch.where(valid, matched_at, matched_at[:, :1]))
    return out


def filtered_logits(scaled: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Plain sampling's logits: z / T on candidates, −∞ elsewhere."""
    return scaled.masked_fill(~mask, NEG_INF)


def steer(
    scaled: torch.Tensor,  # [R, V] z / T
    mask: torch.Tensor,  # [R, V] candidates
    prediction: torch.Tensor,  # [R, H]
    lm_head: torch.Tensor,  # [V, H]
    a: torch.Tensor,  # [R, 1] mix coefficients (``mix_coefficients``)
    b: torch.Tensor,  # [R, 1]
    bias: torch.Tensor | None = None,
    width: int | None = None,
    matched: torch.Tensor | None = None,  # [R, 1] bool: rows whose mix matches plain entropy
) -> torch.Tensor:
    """ESamp's logits [R, V]: the mix on each row's candidates, −∞ elsewhere, with d computed
    only at the candidates (``width``: the widest row's candidate count, when known); the
    ``matched`` rows then take ``match_entropy``.
    """
    ids, valid = candidate_ids(mask, scaled, width)
    z_at = scaled.gather(1, ids)
    d_at = distiller_logits_at(prediction, lm_head, ids, bias)
    a, b = a.to(z_at.device), b.to(z_at.device)
    steered = mixed(z_at, d_at, a, b).masked_fill(~valid, NEG_INF)
    if matched is not None:
        steered = match_entropy(steered, z_at.masked_fill(~valid, NEG_INF), b * d_at, matched)
    out = torch.full_like(scaled, NEG_INF)
    # Scatter valid entries only: padded ids may repeat a real candidate's id.
    out.scatter_(1, torch.where(valid, ids, ids[:, :1]), torch.where(valid, steered, steered[:, :1]))
    return out


def sample(logits: torch.Tensor, greedy: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row from softmax(logits); greedy rows take the argmax. Returns [R]."""
    probs = logits.softmax(dim=-1)
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return torch.where(greedy.to(logits.device), logits.argmax(dim=-1), drawn)
