"""Reference engine on the CPU: tokens/s with ESamp on vs off, alternating trials in one run,
and model start time cold (GGUF → cached HF directory) and warm.

    .venv/bin/python benchmarks/reference_generate.py --trials 5 --out benchmarks/results/reference-cpu.json

Each trial is what ``esamp generate PROMPT -n 8 --max-tokens 64`` does after loading (the same
engine and event loop), with ignore_eos so every trial produces exactly n × 64 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from esamp.core.config import SamplingConfig, Steering
from esamp.engines.base import run
from esamp.engines.reference import ReferenceEngine

PROMPTS = [
    "Give three different ways to prove there are infinitely many primes.",
    "Write a short story opening about a lighthouse keeper.",
]


def start_time(cache_dir: str) -> float:
    """Seconds from process start to a loaded engine, in a fresh interpreter."""
    code = (
        "import time; t=time.perf_counter(); from esamp.engines.reference import ReferenceEngine; "
        "ReferenceEngine(); print(time.perf_counter()-t)"
    )
    env = {**os.environ, "ESAMP_CACHE_DIR": cache_dir}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as cold_cache:
        cold_wall, cold_load = start_time(cold_cache)
        warm_wall, warm_load = start_time(cold_cache)

    engine = ReferenceEngine()
    arms = {"off": Steering(enabled=False), "on": Steering()}
    rates: dict[str, list[float]] = {"off": [], "on": []}
    sampling = SamplingConfig(n=args.n, max_tokens=args.max_tokens, ignore_eos=True)
    list(run(engine, PROMPTS[0], SamplingConfig(n=2, max_tokens=4), arms["on"]))  # warm-up
    for trial in range(args.trials):
        order = ("off", "on") if trial % 2 == 0 else ("on", "off")
        for arm in order:
            prompt = PROMPTS[trial % len(PROMPTS)]
            t0 = time.perf_counter()
            tokens = sum(
                ev.type == "token" for ev in run(engine, prompt, sampling.model_copy(update={"seed": trial}), arms[arm])
            )
            rates[arm].append(tokens / (time.perf_counter() - t0))
            print(f"trial {trial} {arm:>3}: {rates[arm][-1]:.1f} tok/s ({tokens} tokens)", flush=True)
    ratios = [on / off for on, off in zip(rates["on"], rates["off"])]
    result = {
        "command": "python benchmarks/reference_generate.py " + " ".join(sys.argv[1:]),
        "workload": f"n={args.n} x {args.max_tokens} tokens, ignore_eos, 2 prompts alternating",
        "device": f"CPU ({platform.processor() or platform.machine()}), {os.cpu_count()} cores, "
        f"torch threads {torch.get_num_threads()}",
        "versions": {
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "python": platform.python_version(),
        },
        "tok_per_s": rates,
        "median_tok_per_s": {k: statistics.median(v) for k, v in rates.items()},
        "ratio_on_over_off": {
            "per_trial": ratios,
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        },
        "start_seconds": {
            "cold_process": cold_wall,
            "cold_engine": cold_load,
            "warm_process": warm_wall,
            "warm_engine": warm_load,
        },
    }
    print(json.dumps({k: result[k] for k in ("median_tok_per_s", "ratio_on_over_off", "start_seconds")}, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
