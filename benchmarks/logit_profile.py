"""What a real model's next-token distributions look like: the target of ``esamp bench --logits realistic``.

Samples the embedded SmolLM2-135M-Instruct plainly (no ESamp) on the built-in ``open`` and ``arith``
prompts and records, for every decode step, the number of candidates the request's filters keep
(|C|) and the entropy of softmax(z/T) over the whole vocabulary, under each filter setting the
bench uses (its default T 0.8, top-p 0.95, min-p 0.1, and the published runtime's fair preset,
top-p 1.0, min-p 0.05). Writes JSON with the means, the distribution and the command.

    python benchmarks/logit_profile.py --json benchmarks/results/logit-profile-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch


def main() -> int:
    from esamp.commands.bench.workloads import PRESETS
    from esamp.core import intervention as iv
    from esamp.engines.reference import ReferenceEngine
    from esamp.eval.builtin_sets import ARITH, OPEN

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--tokens", type=int, default=64, help="tokens per sample")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", required=True)
    args = p.parse_args()

    engine = ReferenceEngine(threads=args.threads)
    prompts = [q for _, q in OPEN] + [q for _, q, _ in ARITH[:16]]
    settings = {name: preset["sampling"] for name, preset in PRESETS.items()}
    stats = {name: {"candidates": [], "entropy": []} for name in settings}
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([engine.encode(prompt)] * args.samples)
            past = None
            for _ in range(args.tokens):
                out = engine.model(input_ids=ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
                past = out.past_key_values
                z = out.logits[:, -1, :].float()
                for name, s in settings.items():
                    scaled = z / s["temperature"]
                    R = scaled.shape[0]
                    mask = iv.candidate_mask(
                        scaled,
                        torch.full((R,), s.get("top_k", 0)),
                        torch.full((R,), s["top_p"]),
                        torch.full((R,), s["min_p"]),
                    )
                    logp = scaled.log_softmax(-1)
                    stats[name]["candidates"] += mask.sum(-1).tolist()
                    stats[name]["entropy"] += (-(logp.exp() * logp).sum(-1)).tolist()
                # continue with the default setting's plain sampling
                s = settings["default"]
                scaled = z / s["temperature"]
                mask = iv.candidate_mask(
                    scaled,
                    torch.zeros(len(z), dtype=torch.long),
                    torch.full((len(z),), s["top_p"]),
                    torch.full((len(z),), s["min_p"]),
                )
                nxt = iv.sample(iv.filtered_logits(scaled, mask), torch.zeros(len(z), dtype=torch.bool), gen)
                ids = torch.cat([ids, nxt[:, None]], dim=1)
    report = {
        "command": " ".join(["python", *sys.argv]),
        "model": engine.ready.model,
        "prompts": len(prompts),
        "samples": args.samples,
        "tokens": args.tokens,
        "seconds": round(time.perf_counter() - t0, 1),
        "device": f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "settings": {
            name: {
                "sampling": settings[name],
                "candidates_mean": round(statistics.fmean(v["candidates"]), 3),
                "candidates_median": statistics.median(v["candidates"]),
                "candidates_p90": sorted(v["candidates"])[int(0.9 * len(v["candidates"]))],
                "entropy_mean": round(statistics.fmean(v["entropy"]), 3),
                "steps": len(v["candidates"]),
            }
            for name, v in stats.items()
        },
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    for name, v in report["settings"].items():
        print(
            f"{name}: mean |C| {v['candidates_mean']}, median {v['candidates_median']}, "
            f"p90 {v['candidates_p90']}, entropy {v['entropy_mean']} nats over {v['steps']} steps"
        )
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
