"""``esamp bench`` checks memory before it loads anything, and says what would fit."""

from __future__ import annotations

import pytest

from esamp.commands.bench import memory as bench
from esamp.engines.vllm import launch
from esamp.errors import EngineError

GIB = 1024**3


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ESAMP_CACHE_DIR", str(tmp_path))  # the presets write their config.json here
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # a CPU with bf16 arithmetic (16-bit weights) unless a test says otherwise
    monkeypatch.setattr(launch, "cpu_bf16", lambda cpuinfo=None: True)


def _machine(monkeypatch, kind: str, total_gib: float, free_gib: float) -> None:
    monkeypatch.setattr(bench, "_memory_source", lambda: (kind, int(total_gib * GIB), int(free_gib * GIB)))


def test_the_7b_preset_twice_does_not_fit_in_20_gib_of_ram(monkeypatch):
    _machine(monkeypatch, "ram", 23, 20)
    with pytest.raises(EngineError) as info:
        bench.check_memory("qwen2.5-7b:dummy", 2, 0.42, rows=256)
    err = info.value
    assert "2 engines of qwen2.5-7b:dummy" in err.message and "20.0 GiB of available RAM" in err.message
    assert "esamp bench --model qwen2.5-0.5b:dummy (2 engines" in err.hint
    assert "--floor" in err.hint  # with three engines, or a note that --floor needs a third


def test_floor_needs_a_third_engine(monkeypatch):
    _machine(monkeypatch, "ram", 23, 20)
    with pytest.raises(EngineError) as info:
        bench.check_memory("qwen2.5-0.5b:dummy", 3, 0.28, rows=256)
    assert "3 engines" in info.value.message and "baseline, ESamp and floor" in info.value.message
    assert "esamp bench --model qwen2.5-0.5b:dummy (2 engines" in info.value.hint


def test_a_smaller_kv_cache_is_offered_when_nothing_else_fits(monkeypatch):
    _machine(monkeypatch, "ram", 16, 12)
    with pytest.raises(EngineError) as info:
        bench.check_memory("qwen2.5-7b:dummy", 2, 0.42, rows=256)
    assert "VLLM_CPU_KVCACHE_SPACE=1 esamp bench --model qwen2.5-0.5b:dummy" in info.value.hint


def test_nothing_fits_names_the_smallest_run(monkeypatch):
    _machine(monkeypatch, "ram", 8, 4)
    with pytest.raises(EngineError) as info:
        bench.check_memory("qwen2.5-7b:dummy", 2, 0.42, rows=256)
    assert "nothing fits" in info.value.hint and "qwen2.5-0.5b:dummy" in info.value.hint


@pytest.mark.parametrize(
    "kind, total, free, model, engines",
    [
        ("ram", 128, 120, "qwen2.5-7b:dummy", 3),
        ("gpu", 80, 79, "qwen2.5-7b:dummy", 2),
        ("gpu", 80, 79, "qwen2.5-7b:dummy", 3),
        ("gpu", 24, 23, "qwen2.5-0.5b:dummy", 3),
    ],
)
def test_what_fits_passes(monkeypatch, kind, total, free, model, engines):
    _machine(monkeypatch, kind, total, free)
    bench.check_memory(model, engines, 0.28 if engines == 3 else 0.42, rows=256)


def test_a_gpu_share_smaller_than_the_weights(monkeypatch):
    _machine(monkeypatch, "gpu", 24, 23)
    with pytest.raises(EngineError) as info:
        bench.check_memory("qwen2.5-7b:dummy", 2, 0.42, rows=256)
    assert "more than one engine's share of the GPU" in info.value.message
    assert "esamp bench --model qwen2.5-0.5b:dummy" in info.value.hint


def test_unknown_memory_lets_vllm_try(monkeypatch):
    monkeypatch.setattr(bench, "_memory_source", lambda: None)
    bench.check_memory("qwen2.5-7b:dummy", 3, 0.28)


def test_a_cpu_without_bf16_arithmetic_counts_float32_weights(monkeypatch):
    """vLLM loads float32 there (``launch.default_dtype``): the 0.5B preset's two engines and a
    1 GiB KV cache each fit 12 GiB with 16-bit weights, not with float32 ones."""
    _machine(monkeypatch, "ram", 16, 12)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    bench.check_memory("qwen2.5-0.5b:dummy", 2, 0.42, rows=256)
    monkeypatch.setattr(launch, "cpu_bf16", lambda cpuinfo=None: False)
    with pytest.raises(EngineError) as info:
        bench.check_memory("qwen2.5-0.5b:dummy", 2, 0.42, rows=256)
    assert "2 engines of qwen2.5-0.5b:dummy" in info.value.message
