"""Memory sampling for the dashboard: GPU memory over NVML, host memory where there is none.

Never raises. What can go wrong on a user's machine, and what the sample says then:

- no ``pynvml`` module, or no NVIDIA driver (``nvmlInit`` fails): the GPU field is ``N/A`` with
  the reason, and host memory is reported so the chart still shows what the engine uses on a CPU;
- a device whose memory NVML does not report (unified-memory parts such as GH200/GB10 answer
  ``NOT_SUPPORTED``): the sample is the host's memory, marked ``unified``;
- any other NVML error on a call: that field is ``N/A`` for this sample, the next one retries.

Results are cached for ``ttl`` seconds (NVML calls cost a few milliseconds and the numbers do not
change faster than that), in the manner of nvitop's sampler. No textual import here.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

GIB = 1024**3


@dataclass(frozen=True)
class MemorySample:
    """One reading. ``kind`` says what ``used``/``total`` measure."""

    kind: str  # "gpu" | "unified" | "host" | "na"
    used: int | None = None  # bytes
    total: int | None = None  # bytes
    device: str = ""  # e.g. "NVIDIA H100 80GB HBM3"; "" when unknown
    utilisation: int | None = None  # GPU busy %, None when unknown
    note: str = ""  # why a field is N/A
    time: float = field(default_factory=time.time)  # when it was read (the charts' time axis)

    @property
    def fraction(self) -> float | None:
        if self.used is None or not self.total:
            return None
        return self.used / self.total

    def label(self) -> str:
        """Short text for a status line, e.g. ``GPU 12.1/80.0 GiB`` or ``host 3.2/7.8 GiB · GPU N/A``."""
        if self.kind == "na" or self.used is None or self.total is None:
            return "mem N/A" + (f" ({self.note})" if self.note else "")
        amount = f"{self.used / GIB:.1f}/{self.total / GIB:.1f} GiB"
        if self.kind == "gpu":
            util = f" {self.utilisation}%" if self.utilisation is not None else ""
            return f"GPU {amount}{util}"
        if self.kind == "unified":
            return f"unified {amount}"
        return f"host {amount} · GPU N/A"


def host_memory() -> tuple[int, int] | None:
    """(used, total) bytes of host RAM, or None if neither psutil nor /proc/meminfo answers."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total - vm.available), int(vm.total)
    except Exception:
        pass
    try:
        fields = {}
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        total = fields["MemTotal"]
        return total - fields.get("MemAvailable", fields.get("MemFree", 0)), total
    except Exception:
        return None


def _visible_index() -> int:
    """The first device named in CUDA_VISIBLE_DEVICES, when it is a plain index; else 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


class MemorySampler:
    """Thread-safe sampler with a short cache; ``sample()`` never raises."""

    def __init__(self, ttl: float = 1.0, device_index: int | None = None) -> None:
        self.ttl = ttl
        self.device_index = _visible_index() if device_index is None else device_index
        self._lock = threading.Lock()
        self._cached: tuple[float, MemorySample] | None = None
        self._nvml = None  # the pynvml module once initialised
        self._nvml_note = ""
        self._handle = None
        self._name = ""
        self._init_nvml()

    def _init_nvml(self) -> None:
        try:
            import pynvml
        except ImportError:
            self._nvml_note = "no NVML: pynvml (nvidia-ml-py) is not installed"
            return
        except Exception as exc:  # a broken install
            self._nvml_note = f"no NVML: {type(exc).__name__}: {exc}"
            return
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
            name = pynvml.nvmlDeviceGetName(self._handle)
            self._name = name.decode() if isinstance(name, bytes) else str(name)
            self._nvml = pynvml
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, InvalidArgument...
            self._nvml_note = "no NVML: " + (str(exc) or type(exc).__name__)
            self._handle = None

    @property
    def nvml_available(self) -> bool:
        return self._nvml is not None

    def sample(self) -> MemorySample:
        with self._lock:
            now = time.monotonic()
            if self._cached and now - self._cached[0] < self.ttl:
                return self._cached[1]
            reading = self._read()
            self._cached = (now, reading)
            return reading

    def _read(self) -> MemorySample:
        if self._nvml is None:
            host = host_memory()
            if host is None:
                return MemorySample("na", note=self._nvml_note or "no memory source")
            return MemorySample("host", host[0], host[1], note=self._nvml_note)
        nv = self._nvml
        util = None
        try:
            util = int(nv.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        except Exception:
            pass
        try:
            info = nv.nvmlDeviceGetMemoryInfo(self._handle)
            if info.total:
                return MemorySample("gpu", int(info.used), int(info.total), self._name, util)
        except Exception as exc:
            not_supported = getattr(nv, "NVMLError_NotSupported", ())
            if not (not_supported and isinstance(exc, not_supported)):
                return MemorySample(
                    "na", device=self._name, utilisation=util, note=f"NVML: {exc or type(exc).__name__}"
                )
        # The device reports no memory of its own: it shares the host's (unified memory).
        host = host_memory()
        if host is None:
            return MemorySample("na", device=self._name, utilisation=util, note="no memory source")
        return MemorySample("unified", host[0], host[1], self._name, util)

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
