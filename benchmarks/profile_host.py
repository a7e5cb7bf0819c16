"""Where the host's time goes in one bench trial, with vLLM's engine core in this process.

Runs one workload on the baseline or on the ESamp engine (as ``esamp bench`` builds them) under
cProfile and prints the functions with the most time, so host-side costs (Python, launches,
waits on the GPU) of the two sides can be compared. One side per process (an in-process engine
core is not built twice). GPU only; it measures, it asserts nothing.

    python benchmarks/profile_host.py --side esamp --model qwen2.5-0.5b:dummy --workload 32xn8x256
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b:dummy")
    ap.add_argument("--workload", default="32xn8x256")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default=".")
    ap.add_argument("--side", choices=("baseline", "esamp"), default="esamp")
    args = ap.parse_args()

    from esamp.commands.bench import workloads
    from esamp.commands.bench.trials import run_trial
    from esamp.commands.bench.worker_extension import BENCH_EXTENSION
    from esamp.commands.bench.workloads import parse_workload
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm.engine import VllmEngine

    P, n, L = parse_workload(args.workload)
    sampling_kw = dict(temperature=0.8, top_p=0.95, min_p=0.1, top_k=0, seed=None)  # as esamp bench
    esamp = EsampConfig()
    side = args.side
    engine = VllmEngine(
        model=args.model,
        esamp=esamp,
        plain=side == "baseline",
        ignore_eos=True,
        max_model_len=2048,
        gpu_memory_utilization=0.42,
        max_num_seqs=max(16, P * n),
        llm_kwargs={"worker_extension_cls": BENCH_EXTENSION},
    )
    vocab = int(json.loads((engine.resolved.hf_dir() / "config.json").read_text())["vocab_size"])
    prompts = workloads.prompts(P, 32, vocab, seed=1)
    es = None if side == "baseline" else esamp.steering
    run_trial(engine, prompts, n, min(L, 16), sampling_kw, es)
    profile = cProfile.Profile()
    profile.enable()
    result = run_trial(engine, prompts, n, L, sampling_kw, es)
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    counters = engine.drain().get("counters", {})
    header = f"== {side} {args.workload} on {args.model}: {result['tok_s']} tok/s; counters {counters}\n"
    with open(os.path.join(args.out, f"profile-{side}.txt"), "w") as f:
        f.write(header + text.getvalue())
    print(header + "\n".join(text.getvalue().splitlines()[: args.top + 12]), flush=True)
    engine.close()
    del engine
    return 0


if __name__ == "__main__":
    sys.exit(main())
