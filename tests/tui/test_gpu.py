"""The memory sampler never raises: GPU memory, unified memory, host memory or N/A."""

from __future__ import annotations

import sys
import types

from esamp.platform.gpu import GIB, MemorySample, MemorySampler


class NVMLError(Exception):
    pass


class NotSupported(NVMLError):
    pass


def fake_nvml(memory=None, init_error=None, memory_error=None):
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.NVMLError_NotSupported = NotSupported

    def init():
        if init_error:
            raise init_error

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    m.nvmlDeviceGetName = lambda h: b"Fake GPU"
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=42)

    def mem(h):
        if memory_error:
            raise memory_error
        return memory

    m.nvmlDeviceGetMemoryInfo = mem
    return m


def test_gpu_memory(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(types.SimpleNamespace(used=2 * GIB, total=8 * GIB)))
    s = MemorySampler(ttl=0).sample()
    assert (s.kind, s.used, s.total, s.device, s.utilisation) == ("gpu", 2 * GIB, 8 * GIB, "Fake GPU", 42)
    assert s.label() == "GPU 2.0/8.0 GiB 42%"


def test_unified_memory_when_the_device_reports_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(memory_error=NotSupported("not supported")))
    s = MemorySampler(ttl=0).sample()
    assert s.kind == "unified" and s.total and s.used is not None and s.label().startswith("unified ")


def test_no_nvml_library_reports_host_memory_and_gpu_na(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(init_error=NVMLError("NVML Shared Library Not Found")))
    sampler = MemorySampler(ttl=0)
    assert not sampler.nvml_available
    s = sampler.sample()
    assert s.kind == "host" and "Library Not Found" in s.note
    assert s.label().startswith("host ") and s.label().endswith("· GPU N/A")


def test_pynvml_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    s = MemorySampler(ttl=0).sample()
    assert s.kind == "host" and "not installed" in s.note


def test_other_nvml_error_is_na_not_a_crash(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(memory_error=NVMLError("GPU is lost")))
    s = MemorySampler(ttl=0).sample()
    assert s.kind == "na" and "GPU is lost" in s.note and s.label().startswith("mem N/A")


def test_no_memory_source_at_all(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr("esamp.platform.gpu.host_memory", lambda: None)
    assert MemorySampler(ttl=0).sample().kind == "na"


def test_cached_within_ttl(monkeypatch):
    calls = []
    m = fake_nvml(types.SimpleNamespace(used=1, total=2))
    real = m.nvmlDeviceGetMemoryInfo
    m.nvmlDeviceGetMemoryInfo = lambda h: calls.append(1) or real(h)
    monkeypatch.setitem(sys.modules, "pynvml", m)
    sampler = MemorySampler(ttl=60)
    sampler.sample(), sampler.sample()
    assert len(calls) == 1


def test_sample_label_na():
    assert MemorySample("na", note="x").label() == "mem N/A (x)"
