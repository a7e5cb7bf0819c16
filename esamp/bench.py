"""``esamp bench``: ESamp's throughput against plain vLLM, in one invocation.

Two engines stay loaded side by side: the baseline is plain vLLM (the model's own class, no
logits processor, CUDA graphs as configured), the other is the ESamp engine. Trials alternate
(base, esamp, esamp, base, ...) on identical token-id prompts and sampling settings, every
sample runs to exactly its token budget (``ignore_eos``), and each trial is timed from the first
request to the last token. Workloads are ``PxL`` (P prompts × L tokens, n=1) or ``PxnNxL``
(P prompts × n=N samples × L tokens).

Output: a table on stdout and a JSON file with per-trial tok/s, the ESamp/baseline ratio (median
of the per-pair ratios, with min and max), the Distiller's loss count and first/last loss, port
hits, mean candidate count, peak GPU memory of each engine, device, versions and the exact command.

``--floor`` adds a third side, alternated with the other two: the ESamp engine (tap model class
and logits processor installed) running every request with ESamp off. Its ratio to the baseline
is what the seams cost by themselves, before any Distiller or steering work.

Sampling draws without per-request seeds unless ``--seed`` is given: with a seed, vLLM's sampler
draws each row with its own generator (one kernel launch per row and step), which slows both
sides alike and makes the engine bound by its host.
"""

from __future__ import annotations

import json
import os
import platform
import random
import re
import statistics
import sys
import time
from pathlib import Path

from esamp.errors import ConfigError

HELP = "measure ESamp's throughput against plain vLLM (alternating trials, JSON result)"

WORKLOADS = ("16x64", "32xn8x256")


def parse_workload(spec: str) -> tuple[int, int, int]:
    """``16x64`` → (16, 1, 64); ``32xn8x256`` → (32, 8, 256)."""
    m = re.fullmatch(r"(\d+)x(?:n(\d+)x)?(\d+)", spec.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(3)) < 1 or (m.group(2) and int(m.group(2)) < 1):
        raise ConfigError(f"bad workload {spec!r}",
                          hint="write PROMPTSxTOKENS (16x64) or PROMPTSxnSAMPLESxTOKENS (32xn8x256)")
    return int(m.group(1)), int(m.group(2) or 1), int(m.group(3))


def configure(parser) -> None:
    parser.add_argument("--model", default="qwen2.5-7b:dummy",
                        help="model spec (default: qwen2.5-7b:dummy, random weights)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help="comma-separated workloads (default: %(default)s)")
    parser.add_argument("--trials", type=int, default=3, help="timed trials per side and workload")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens")
    parser.add_argument("--eager", action="store_true", help="every side without CUDA graphs")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="share of GPU memory for EACH engine (default: 0.42, or 0.28 with --floor)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--beta", type=float, default=0.8)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--min-p", type=float, default=0.1)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None,
                        help="per-request sampling seeds (seed + sample); default: none, as in serving")
    parser.add_argument("--floor", action="store_true",
                        help="also time the ESamp engine with ESamp off on every request (the seams' own cost)")
    parser.add_argument("--json", dest="json_path", default=None,
                        help="where to write the JSON result (default: benchmarks/results/bench-MODEL-DATE.json)")


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("vllm", "torch", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    from esamp import __version__

    out["esamp"] = __version__
    return out


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def run_trial(engine, prompts, n: int, tokens: int, sampling_kw: dict, esamp) -> dict:
    """Run every prompt as a group of n samples to ``tokens`` tokens; time and count."""
    from esamp.core.config import SamplingConfig

    sampling = SamplingConfig(n=n, max_tokens=tokens, **sampling_kw)
    c0 = time.process_time()
    t0 = time.perf_counter()
    for p in prompts:
        engine.start(p, sampling, esamp)
    produced, losses, port_hits, cands = 0, [], 0, []
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.type == "done":
                produced += ev.tokens
            elif ev.type == "step":
                port_hits += ev.port_hits
                if ev.loss is not None:
                    losses.append(ev.loss)
                if ev.port_hits:
                    cands.append(ev.candidates)
    seconds = time.perf_counter() - t0
    client = time.process_time() - c0
    if hasattr(engine, "drain"):
        engine.drain()  # release the groups' slots before the next trial
    # client_cpu_share near 1: this process (event bookkeeping), not the engine, set the pace
    return dict(tokens=produced, seconds=round(seconds, 4), tok_s=round(produced / seconds, 2),
                client_cpu_share=round(client / seconds, 3),
                loss_count=len(losses), loss_first=losses[0] if losses else None,
                loss_last=losses[-1] if losses else None, port_hits=port_hits,
                candidates_mean=round(sum(cands) / len(cands), 2) if cands else 0.0)


def _peak_memory(engine) -> float | None:
    try:
        return engine.engine.collective_rpc("esamp_memory")[0]
    except Exception:
        return None


def run(args) -> int:
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm.engine import VllmEngine

    workloads = [parse_workload(w) for w in args.workloads.split(",") if w.strip()]
    if args.trials < 1:
        raise ConfigError("--trials must be at least 1", hint="use --trials 3")
    if args.seed is not None and args.seed < 0:
        raise ConfigError(f"--seed must be 0 or more, not {args.seed}", hint="leave it out for unseeded sampling")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization < 1:
        raise ConfigError(f"--gpu-memory-utilization is a share of the GPU per engine, not {args.gpu_memory_utilization}",
                          hint="use e.g. 0.42 (two engines) or 0.28 (three, with --floor)")
    esamp = EsampConfig(beta=args.beta)
    off = esamp.model_copy(update={"enabled": False})
    max_seqs = max(p * n for p, n, _ in workloads)
    share = args.gpu_memory_utilization or (0.28 if args.floor else 0.42)
    common = dict(model=args.model, max_model_len=args.max_model_len,
                  gpu_memory_utilization=share, ignore_eos=True,
                  max_num_seqs=max(max_seqs, 16), enforce_eager=True if args.eager else None)
    loads = {}
    t0 = time.perf_counter()
    base = VllmEngine(plain=True, **common)
    loads["baseline"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    steer = VllmEngine(esamp=esamp, **common)
    loads["esamp"] = round(time.perf_counter() - t0, 1)
    sides = [("baseline", base, None), ("esamp", steer, esamp)]
    floor = None
    if args.floor:
        t0 = time.perf_counter()
        floor = VllmEngine(esamp=esamp, **common)
        loads["floor"] = round(time.perf_counter() - t0, 1)
        sides.insert(1, ("floor", floor, off))
    sampling_kw = dict(temperature=args.temperature, top_p=args.top_p, min_p=args.min_p,
                       top_k=args.top_k, seed=args.seed)
    vocab = 32000
    try:
        vocab = int(json.loads((base.resolved.hf_dir() / "config.json").read_text())["vocab_size"])
    except Exception:
        pass
    results = []
    for P, n, L in workloads:
        name = f"{P}x{L}" if n == 1 else f"{P}xn{n}x{L}"
        prompts = _prompts(P, args.prompt_len, vocab, seed=P * 1000 + n * 10 + L)
        # warm-up: one short pass per side at the workload's batch shape
        for _, eng, es in sides:
            run_trial(eng, prompts, n, min(L, 16), sampling_kw, es)
        trials = []
        for t in range(args.trials):
            order = list(sides)
            if t % 2:
                order.reverse()
            for side, eng, es in order:
                r = run_trial(eng, prompts, n, L, sampling_kw, es)
                r.update(side=side, trial=t)
                trials.append(r)
                print(f"  {name:>10} trial {t} {side:>8}: {r['tok_s']:>10.1f} tok/s  "
                      f"(client cpu {r['client_cpu_share']:.0%})", flush=True)
        b = [r["tok_s"] for r in trials if r["side"] == "baseline"]
        e = [r["tok_s"] for r in trials if r["side"] == "esamp"]
        ratios = [ei / bi for ei, bi in zip(e, b)]
        es_trials = [r for r in trials if r["side"] == "esamp"]
        extra = {}
        if floor is not None:
            f = [r["tok_s"] for r in trials if r["side"] == "floor"]
            floor_ratios = [fi / bi for fi, bi in zip(f, b)]
            extra = dict(floor_tok_s_median=statistics.median(f),
                         floor_ratio_median=round(statistics.median(floor_ratios), 4),
                         floor_ratio_min=round(min(floor_ratios), 4), floor_ratio_max=round(max(floor_ratios), 4))
        results.append(dict(
            workload=name, prompts=P, n=n, tokens=L, trials=trials,
            baseline_tok_s_median=statistics.median(b), esamp_tok_s_median=statistics.median(e),
            ratio_median=round(statistics.median(ratios), 4), ratio_min=round(min(ratios), 4),
            ratio_max=round(max(ratios), 4),
            ratio_of_medians=round(statistics.median(e) / statistics.median(b), 4),
            loss_count=[r["loss_count"] for r in es_trials],
            loss_first=[r["loss_first"] for r in es_trials], loss_last=[r["loss_last"] for r in es_trials],
            port_hits=[r["port_hits"] for r in es_trials],
            candidates_mean=[r["candidates_mean"] for r in es_trials],
            **extra,
        ))
    report = dict(
        command=" ".join(["esamp", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else " ".join(sys.argv),
        device=_device(), versions=_versions(), model=args.model,
        cuda_graphs=not args.eager, sampling=sampling_kw, esamp=esamp.model_dump(),
        prompt_len=args.prompt_len, load_seconds=loads,
        peak_memory_bytes={side: _peak_memory(eng) for side, eng, _ in sides},
        esamp_counters=steer.drain().get("counters", {}),
        workloads=results, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    for _, eng, _ in sides:
        eng.close()
    print()
    print(f"{'workload':>12} {'baseline tok/s':>15} {'esamp tok/s':>12} {'ratio':>7} {'(min..max)':>14} "
          f"{'losses':>7} {'port hits':>10} {'cands':>8}")
    for r in results:
        print(f"{r['workload']:>12} {r['baseline_tok_s_median']:>15.1f} {r['esamp_tok_s_median']:>12.1f} "
              f"{r['ratio_median']:>7.3f} {r['ratio_min']:>6.3f}..{r['ratio_max']:<6.3f} "
              f"{r['loss_count'][-1]:>7} {r['port_hits'][-1]:>10} {r['candidates_mean'][-1]:>8.1f}")
        if "floor_ratio_median" in r:
            print(f"{'':>12} floor (ESamp engine, ESamp off): {r['floor_tok_s_median']:.1f} tok/s, ratio "
                  f"{r['floor_ratio_median']:.3f} {r['floor_ratio_min']:.3f}..{r['floor_ratio_max']:.3f}")
    print(f"device: {report['device']}; vllm {report['versions']['vllm']}, torch {report['versions']['torch']}")
    path = Path(args.json_path) if args.json_path else (
        Path("benchmarks/results") / f"bench-{args.model.replace(':', '-').replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0
