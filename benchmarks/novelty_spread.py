"""How widely the Distiller logits d spread over the candidates, next to the model's own z̃ = z/T.

The paper's mix is z' = (1+β)·z̃ − β·d on the candidate set C, the unsharpened one z̃ − β·d. If d
spans a wider range over C than z̃ does, −β·d alone sharpens or flattens the candidate
distribution, and a mix meant to reward novelty also acts as a temperature. This measures it on
the embedded model (the reference engine on the CPU) during real ESamp runs: every steered row
with |C| ≥ 2, at every step of every group, gives the standard deviation and the range of z̃ and
of d over C, their correlation and the slope of d on z̃ (least squares over C), and the entropy
of the candidate distribution under plain sampling and under each named mix (the same row, the
same d: what each mix would do with it, through the core's ``intervention.steer``), and under a
"calibrated" variant (d centred over C and scaled to z̃'s spread there) that is not a mix.

The runs sample with the mix given by ``--mix`` (default: the paper's, the default setting);
the other mixes are evaluated on the rows that run produced.

Beside it, a control for the eval's learning plot: at every step, the mean error e of the rows
under the group's Distiller as trained so far, and under a frozen copy at its initial weights on
the same rows. The trained error falling against the frozen one is learning; the frozen error's
own trend is what the position in a reply does to e by itself.

    python benchmarks/novelty_spread.py --threads 1 --json benchmarks/results/novelty-spread-cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

SAME = 1e-4  # nats: entropies this close count as equal (the mixes run in fp32)


def quantiles(values: list[float]) -> dict:
    """Median and the 10th / 90th percentiles (and the mean) of ``values``."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "n": len(values),
        "mean": round(statistics.fmean(values), 4),
        "p10": round(at(0.1), 4),
        "median": round(statistics.median(values), 4),
        "p90": round(at(0.9), 4),
    }


def entropy(logits: torch.Tensor) -> float:
    """Entropy (nats) of softmax over the finite entries of a 1-D tensor."""
    logp = logits.log_softmax(-1)
    p = logp.exp()
    return float(-(p * logp).sum())


def row_stats(z: torch.Tensor, d: torch.Tensor, beta: float) -> dict:
    """The spreads of z̃ and d over one row's candidates (1-D tensors of |C| ≥ 2 values), their
    correlation and slope, and what a "calibrated" mix would do: z̃ − β·d̂ with d̂ = d centred
    over C and scaled to z̃'s standard deviation there (not a named mix; measured to choose)."""
    z64, d64 = z.double(), d.double()
    zc, dc = z64 - z64.mean(), d64 - d64.mean()
    std_z, std_d = float(zc.pow(2).mean().sqrt()), float(dc.pow(2).mean().sqrt())
    corr = float((zc * dc).mean() / (std_z * std_d)) if std_z > 0 and std_d > 0 else float("nan")
    slope = float((zc * dc).mean() / zc.pow(2).mean()) if std_z > 0 else float("nan")
    calibrated = z64 - beta * dc * (std_z / std_d) if std_d > 0 else z64
    return {
        "k": int(z.numel()),
        "std_z": std_z,
        "std_d": std_d,
        "range_z": float(z64.max() - z64.min()),
        "range_d": float(d64.max() - d64.min()),
        "corr": corr,
        "slope": slope,
        "h_plain": entropy(z64),
        "h_calibrated": entropy(calibrated),
        "flip_calibrated": int(calibrated.argmax()) != int(z.argmax()),
    }


def summarise(rows: list[dict], names: list[str]) -> dict:
    spread = [r for r in rows if r["k"] >= 2]
    ratio_std = [r["std_d"] / r["std_z"] for r in spread if r["std_z"] > 0]
    ratio_range = [r["range_d"] / r["range_z"] for r in spread if r["range_z"] > 0]
    out = {
        "rows": len(rows),
        "rows_with_two_or_more_candidates": len(spread),
        "candidates": quantiles([float(r["k"]) for r in rows]),
        "std_z": quantiles([r["std_z"] for r in spread]),
        "std_d": quantiles([r["std_d"] for r in spread]),
        "range_z": quantiles([r["range_z"] for r in spread]),
        "range_d": quantiles([r["range_d"] for r in spread]),
        "std_d_over_std_z": quantiles(ratio_std),
        "range_d_over_range_z": quantiles(ratio_range),
        "share_range_d_wider": round(sum(r["range_d"] > r["range_z"] for r in spread) / max(len(spread), 1), 4),
        "corr_d_z": quantiles([r["corr"] for r in spread if not math.isnan(r["corr"])]),
        "slope_d_on_z": quantiles([r["slope"] for r in spread if not math.isnan(r["slope"])]),
        "entropy_plain": quantiles([r["h_plain"] for r in spread]),
    }
    for name in names + ["calibrated"]:
        out[f"entropy_{name}"] = quantiles([r[f"h_{name}"] for r in spread])
        out[f"entropy_{name}_minus_plain"] = quantiles([r[f"h_{name}"] - r["h_plain"] for r in spread])
        out[f"share_{name}_flatter"] = round(
            sum(r[f"h_{name}"] > r["h_plain"] + SAME for r in spread) / max(len(spread), 1), 4
        )
        out[f"share_{name}_sharper"] = round(
            sum(r[f"h_{name}"] < r["h_plain"] - SAME for r in spread) / max(len(spread), 1), 4
        )
        out[f"share_{name}_argmax_flips"] = round(sum(r[f"flip_{name}"] for r in spread) / max(len(spread), 1), 4)
    return out


WINDOWS = ((0, 0), (1, 8), (9, 32), (33, 10**9))  # group steps: the prompt, positions 0–7, 8–31, 32 on


def control(steps: list[dict]) -> dict:
    """Mean trained and frozen error per window of group steps, and their ratio."""
    out = {}
    for first, last in WINDOWS:
        picked = [s for s in steps if first <= s["step"] <= last]
        if not picked:
            continue
        trained = statistics.fmean(s["trained"] for s in picked)
        frozen = statistics.fmean(s["frozen"] for s in picked)
        name = (
            "prompt"
            if last == 0
            else f"positions {first - 1}-{last - 1}"
            if last < 10**9
            else f"positions {first - 1} on"
        )
        out[name] = {
            "steps": len(picked),
            "trained": round(trained, 4),
            "frozen": round(frozen, 4),
            "trained_over_frozen": round(trained / frozen, 4),
        }
    return out


def code_version() -> str:
    """The commit this script ran on, marked when the tree had changes."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=os.path.dirname(__file__) or "."
        ).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (
        "+changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    )


def main() -> int:
    from esamp.core import intervention as iv, mixes
    from esamp.core.config import EsampConfig, SamplingConfig, make_config
    from esamp.engines.base import run
    from esamp.engines.reference import ReferenceEngine
    from esamp.eval.tasks import load_task

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arith", type=int, default=6, help="the first N arith problems")
    p.add_argument("--open", type=int, default=6, help="the first N open prompts")
    p.add_argument("-n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--beta", type=float, default=0.8)
    p.add_argument("--mix", default="paper", choices=list(mixes.MIXES), help="the mix the runs sample with")
    p.add_argument("--early", type=int, default=8, help="steps counted as a group's early steps")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", required=True)
    args = p.parse_args()

    engine = ReferenceEngine(threads=args.threads)
    problems = load_task("arith")[: args.arith] + load_task("open")[: args.open]
    steering = make_config(EsampConfig, beta=args.beta, mix=args.mix).steering
    rows: list[dict] = []
    state = {"step": 0, "problem": ""}
    original = engine.steerer.mix_at_candidates

    def watched(plan, scaled, prediction, lm_head):
        """Record every steered row's z̃ and d over C and what each named mix does with them (the
        core's own ``intervention.steer``), then mix as the engine would."""
        mask = torch.isfinite(scaled)
        ids, valid = iv.candidate_ids(mask, scaled)
        z_at = scaled.gather(1, ids)
        d_at = iv.distiller_logits_at(prediction, lm_head, ids)
        R = scaled.shape[0]
        by_mix = {}
        for name in mixes.MIXES:
            a, b = iv.mix_coefficients([(name, args.beta)] * R)
            matched = torch.tensor(iv.entropy_matched([(name, args.beta)] * R)).reshape(-1, 1)
            out = iv.steer(scaled, mask, prediction, lm_head, a, b, matched=matched)
            by_mix[name] = (iv.candidate_entropy(out).tolist(), out.argmax(dim=-1).tolist())
        first = scaled.argmax(dim=-1).tolist()
        for r in range(R):
            keep = valid[r]
            z, d = z_at[r][keep], d_at[r][keep]
            row = {"k": int(z.numel()), "step": state["step"], "problem": state["problem"]}
            if z.numel() >= 2:
                row.update(row_stats(z, d, args.beta))
                for name, (h, top) in by_mix.items():
                    row[f"h_{name}"], row[f"flip_{name}"] = h[r], top[r] != first[r]
            rows.append(row)
        state["step"] += 1
        return original(plan, scaled, prediction, lm_head)

    engine.steerer.mix_at_candidates = watched

    from dataclasses import replace

    from esamp.core.distiller import DistillerBank

    cfg = engine.esamp
    frozen = DistillerBank(
        engine.hidden, rank=cfg.rank, slots=cfg.slots, lr=cfg.lr, optimizer=cfg.optimizer, seed=cfg.seed
    )  # every slot at the initial weights the engine's slots start from
    learning: list[dict] = []
    distill = engine.steerer.distill

    def watched_distill(plan, x, y, normalize=None, out_dtype=None):
        """The trained Distiller's step, and the frozen copy's errors on the same rows."""
        _, fixed, _ = frozen.step(x, y, replace(plan.layout, training=()))
        prediction, errors, loss = distill(plan, x, y, normalize, out_dtype)
        learning.append({"step": state["step"], "trained": float(errors.mean()), "frozen": float(fixed.mean())})
        return prediction, errors, loss

    engine.steerer.distill = watched_distill
    t0 = time.perf_counter()
    for number, problem in enumerate(problems):
        state.update(step=0, problem=problem.id)
        sampling = make_config(SamplingConfig, n=args.n, max_tokens=args.max_tokens, seed=number)
        for _ in run(engine, problem.prompt, sampling, steering):
            pass
        print(f"{problem.id}: {state['step']} steps", file=sys.stderr)
    seconds = time.perf_counter() - t0
    names = list(mixes.MIXES)
    import importlib.metadata as md

    report = {
        "command": " ".join(["python", *sys.argv]),
        "what": __doc__.split("\n\n")[0],
        "environment": {
            "code": code_version(),
            "model": engine.ready.model,
            "engine": "reference",
            "device": engine.ready.device,
            "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "threads": args.threads,
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": md.version("transformers"),
                "esamp": md.version("esamp"),
            },
        },
        "settings": {
            "problems": [p.id for p in problems],
            "n": args.n,
            "max_tokens": args.max_tokens,
            "beta": args.beta,
            "sampled_with_mix": args.mix,
            "sampling": SamplingConfig().model_dump(include={"temperature", "top_p", "top_k", "min_p"}),
            "mixes": {name: mixes.MIXES[name].formula for name in names},
        },
        "seconds": round(seconds, 1),
        "all_steps": summarise(rows, names),
        f"steps_below_{args.early}": summarise([r for r in rows if r["step"] < args.early], names),
        f"steps_from_{args.early}": summarise([r for r in rows if r["step"] >= args.early], names),
        "learning_control": control(learning),
    }
    with open(args.json, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=2)
        fh.write("\n")
    s = report["all_steps"]
    print(
        f"{s['rows_with_two_or_more_candidates']} of {s['rows']} rows with |C| >= 2; "
        f"median std(d)/std(z~) {s['std_d_over_std_z'].get('median')}, range(d) wider than range(z~) in "
        f"{s['share_range_d_wider']:.0%}; median corr(d, z~) {s['corr_d_z'].get('median')}"
    )
    for name in names + ["calibrated"]:
        print(
            f"  {name}: entropy - plain, median {s[f'entropy_{name}_minus_plain'].get('median')}, "
            f"mean {s[f'entropy_{name}_minus_plain'].get('mean')}; flatter in {s[f'share_{name}_flatter']:.0%}, "
            f"sharper in {s[f'share_{name}_sharper']:.0%}, argmax flips in {s[f'share_{name}_argmax_flips']:.0%}"
        )
    for window, c in report["learning_control"].items():
        print(f"  {window}: error trained {c['trained']}, frozen {c['frozen']} (ratio {c['trained_over_frozen']})")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
