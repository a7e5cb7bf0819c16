"""Where the host's time goes in one bench trial, with vLLM's engine core in this process.

Runs one workload on the baseline or on the ESamp engine (as ``esamp bench`` builds them) under
cProfile and prints the functions with the most time, so host-side costs (Python, launches,
waits on the GPU) of the two sides can be compared. One side per process (an in-process engine
core is not built twice). GPU only; it measures, it asserts nothing.

With ``--tensor-parallel-size`` above 1 the workers are processes of their own: each profiles its
own step thread (the bench's worker extension, ``esamp_host_profile``) and the text of every rank
is written beside this process's (``profile-SIDE-rankN.txt``): where rank 0, which runs the
Distiller, spends the host time that rank 1 waits for.

    python benchmarks/profile_host.py --side esamp --model qwen2.5-0.5b:dummy --workload 32xn8x256
    python benchmarks/profile_host.py --side esamp --model qwen2.5-7b:dummy --workload fair --tensor-parallel-size 2
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
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    args = ap.parse_args()

    from esamp.commands.bench import workloads
    from esamp.commands.bench.trials import run_trial
    from esamp.commands.bench.worker_extension import BENCH_EXTENSION
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm.engine import VllmEngine

    ((preset_name, (P, n, L)),) = workloads.parse_workloads(args.workload)  # a shape or a preset (fair)
    preset = workloads.PRESETS[preset_name]
    sampling_kw = dict(preset["sampling"], seed=None)  # the workload's filters, as esamp bench runs it
    esamp = EsampConfig()
    side = args.side
    engine = VllmEngine(
        model=args.model,
        esamp=esamp,
        plain=side == "baseline",
        max_model_len=2048,
        gpu_memory_utilization=0.42,
        max_num_seqs=max(16, P * n),
        tensor_parallel_size=args.tensor_parallel_size,
        llm_kwargs={"worker_extension_cls": BENCH_EXTENSION},
    )
    workers = args.tensor_parallel_size > 1  # else the worker runs in this thread, under the profile below
    vocab = int(json.loads((engine.resolved.hf_dir() / "config.json").read_text())["vocab_size"])
    prompts = workloads.prompts(P, 32, vocab, seed=1)
    es = None if side == "baseline" else esamp.steering.model_copy(update={"beta": preset["steering"]["beta"]})
    run_trial(engine, prompts, n, min(L, 16), sampling_kw, es)
    if workers:
        engine.workers("esamp_host_profile", "start")
    profile = cProfile.Profile()
    profile.enable()
    result = run_trial(engine, prompts, n, L, sampling_kw, es)
    profile.disable()
    if workers:
        for rank, text in enumerate(engine.workers("esamp_host_profile", "stop", args.top)):
            with open(os.path.join(args.out, f"profile-{side}-rank{rank}.txt"), "w") as f:
                f.write(f"== {side} {args.workload} on {args.model}, tensor-parallel rank {rank}\n{text}")
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
