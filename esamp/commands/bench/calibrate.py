"""``--logits realistic``: the dummy model's LM head rescaled to a real model's next-token distributions.

Token v's row is multiplied by s·(r_v + 1)^−α, r_v a seeded random rank, with (α, s) chosen so
that simulated rows (z_v = s·(r_v+1)^−α·σ_v·g, σ_v the spread of W_v·h for the model's final-norm
weights, g ~ N(0, 1)) match the embedded SmolLM2-135M-Instruct's mean |C| and entropy under the
default filters (``REAL_MODEL``, measured by ``benchmarks/logit_profile.py``); then the scale is
refined until the ESamp engine itself keeps that many candidates. Every side shares the scaled head.

``realistic_head`` does it all once, for ``esamp bench`` (engines in this process) and for
``benchmarks/serve_bench.py`` (two servers, through vLLM's ``/collective_rpc``): the caller says how
the ESamp side's head is rescaled and then hands the factors to every side.
"""

from __future__ import annotations

import math

from esamp.commands.bench.trials import run_trial
from esamp.commands.bench.workloads import prompts

# The embedded SmolLM2-135M-Instruct's next-token distributions, per preset's filters
# (benchmarks/results/logit-profile-cpu.json, benchmarks/logit_profile.py).
REAL_MODEL = {"default": dict(candidates=2.96, entropy=1.26), "fair": dict(candidates=4.51, entropy=1.26)}


def _simulate(sigma, factors, filters: dict, rows: int, gen):
    """Mean |C| and entropy of rows z_v = factors_v·σ_v·g_v under ``filters`` (torch, any device)."""
    import torch

    from esamp.core import intervention as iv

    scale = (factors * sigma).unsqueeze(0)
    z = torch.randn(rows, sigma.numel(), generator=gen, device=sigma.device) * scale / filters["temperature"]
    R = rows
    mask = iv.candidate_mask(
        z, torch.full((R,), filters["top_k"]), torch.full((R,), filters["top_p"]), torch.full((R,), filters["min_p"])
    )
    logp = z.log_softmax(-1)
    return float(mask.sum(-1).float().mean()), float(-(logp.exp() * logp).sum(-1).mean())


def calibrate_head(sigma: list[float], target: dict, filters: dict, seed: int = 0) -> dict:
    """(α, s) for the realistic profile (module docstring), matching ``target`` |C| and entropy."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sig = torch.tensor(sigma, dtype=torch.float32, device=device)
    V = sig.numel()
    rank = torch.randperm(V, generator=torch.Generator().manual_seed(seed)).to(device).float()
    best = None
    for alpha in (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5):
        profile = (rank + 1).pow(-alpha)
        lo, hi = math.log(1e-3), math.log(1e6)
        for _ in range(28):  # |C| falls as s grows: bisect log s
            mid = (lo + hi) / 2
            cands, _ = _simulate(
                sig, profile * math.exp(mid), filters, 16, torch.Generator(device=device).manual_seed(seed)
            )
            lo, hi = (mid, hi) if cands > target["candidates"] else (lo, mid)
        s = math.exp((lo + hi) / 2)
        cands, ent = _simulate(sig, profile * s, filters, 64, torch.Generator(device=device).manual_seed(seed + 1))
        miss = abs(ent - target["entropy"]) + abs(cands - target["candidates"])
        if best is None or miss < best["miss"]:
            best = dict(alpha=alpha, scale=s, candidates=round(cands, 3), entropy=round(ent, 3), miss=miss)
    profile = (rank + 1).pow(-best["alpha"]) * best["scale"]
    best["factors"] = profile.cpu().tolist()
    return best


def head_sigma(engine) -> list[float]:
    """The spread σ_v of every token's logit over the whole vocabulary: each tensor-parallel
    worker answers for its shard, in rank order (``EsampBenchExtension.esamp_head_sigma``)."""
    return [v for shard in engine.workers("esamp_head_sigma") for v in shard]


def scale_heads(sides, factors: list[float] | None) -> None:
    for _, eng, _ in sides:
        eng.engine.collective_rpc("esamp_scale_head", args=(factors,))


def refine_scale(
    engine, factors: list[float], target: float, prompts, sampling_kw: dict, steering, steps: int = 8, scale=None
) -> tuple[list[float], float, float]:
    """Rescale the simulated profile until the model itself keeps ``target`` candidates on average
    (measured by the ESamp engine's processor on short runs of ``engine``, an in-process engine or
    a served one): (factors, measured mean |C|, the multiplier applied to the simulated profile).
    ``scale(factors)`` rescales the head ``engine`` samples from (default: its own workers')."""
    if scale is None:

        def scale(scaled: list[float]) -> None:
            engine.engine.collective_rpc("esamp_scale_head", args=(scaled,))

    lo, hi, best = -3.0, 3.0, None
    for _ in range(steps):
        mid = (lo + hi) / 2
        scaled = [f * math.exp(mid) for f in factors]
        scale(scaled)
        measured = run_trial(engine, prompts, 1, 8, sampling_kw, steering)["candidates_mean"]
        if best is None or abs(measured - target) < abs(best[1] - target):
            best = (scaled, measured, math.exp(mid))
        lo, hi = (mid, hi) if measured > target else (lo, mid)
    return best


def realistic_head(
    sigma: list[float], filters: dict, engine, steering, prompt_len: int, vocab: int, scale=None
) -> tuple[list[float], dict]:
    """The realistic head, calibrated once: (α, s) from the simulation on ``sigma`` (the unscaled
    head's spreads, ``head_sigma``) under ``filters``, then the scale refined on the ESamp side
    (``engine``, its head rescaled by ``scale``: ``refine_scale``) on 16 short probe prompts.
    Returns (the factors every side's head gets, the calibration a report carries). The ESamp
    side's head is left at the last factors tried: the caller then scales every side alike."""
    target = REAL_MODEL["default"]
    cal = calibrate_head(sigma, target, filters)
    probe = prompts(16, prompt_len, vocab, seed=1)
    factors, measured, multiplier = refine_scale(
        engine, cal.pop("factors"), target["candidates"], probe, dict(filters, seed=None), steering, scale=scale
    )
    return factors, dict(
        cal,
        scale=cal["scale"] * multiplier,
        simulated_scale=cal["scale"],
        target=REAL_MODEL,
        filters=filters,
        measured_candidates=measured,
    )


def describe(calibration: dict) -> str:
    """One line on the realistic head, for a bench's output."""
    return (
        f"realistic logits: head rows × s·(rank+1)^−α with α={calibration['alpha']}: simulated mean |C| "
        f"{calibration['candidates']}, entropy {calibration['entropy']} nats; the model then keeps "
        f"{calibration['measured_candidates']} candidates on average (embedded model: {REAL_MODEL['default']})"
    )
