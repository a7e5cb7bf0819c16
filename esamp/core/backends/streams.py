"""The CUDA stream calls of a steady step, at the cost of the driver call.

A steered step orders a few streams around each other every step: the Distiller's update beside
the current stream (``graphs.SideStream``) and the next reader waiting for it
(``DistillerBank.settle``), the step record's copy. ``torch.cuda``'s Python helpers build a
``Stream`` object for each question and answer it in several layers: on an H100 with torch 2.11,
``torch.cuda.current_stream()`` cost 5.4 µs a call, ``Event.record()`` 9.4 µs,
``with torch.cuda.stream(s)`` 12 µs, a CUDA-graph replay of 16 kernels 3.2 µs
(``benchmarks/host_micro.py --primitives``). These functions ask the same of PyTorch's C layer
directly:

- ``current(device)``: the current stream, a ``Stream`` made once per raw stream handle
  (``index_of`` gives a ``torch.device``'s index);
- ``switch(stream)``: make ``stream`` current (what ``torch.cuda.set_stream`` does);
- ``record(event, stream)``, ``wait(stream, event)``: the event calls with the stream given.

They change nothing PyTorch does (the same C functions, the same streams); the tests hold each one
to ``torch.cuda``'s own answer on a GPU. Where this torch lacks one of the C calls, the
``torch.cuda`` helper stands in.
"""

from __future__ import annotations

import torch

_C = torch._C
_RAW = getattr(_C, "_cuda_getCurrentRawStream", None)
_SET = getattr(_C, "_cuda_setStream", None)
_EVENT = getattr(_C, "_CudaEventBase", None)
_KNOWN: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device, raw handle) → its Stream


def index_of(device: torch.device) -> int:
    """The index of CUDA device ``device`` (the current device for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def current(device: int) -> torch.cuda.Stream:
    """The current stream of CUDA device ``device`` (an index)."""
    if _RAW is None:
        return torch.cuda.current_stream(device)
    key = (device, _RAW(device))
    stream = _KNOWN.get(key)
    if stream is None:
        stream = _KNOWN[key] = torch.cuda.current_stream(device)
    return stream


def switch(stream: torch.cuda.Stream) -> None:
    """Make ``stream`` the current stream of its device."""
    if _SET is None:
        torch.cuda.set_stream(stream)
    else:
        _SET(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type)


def record(event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
    """Record ``event`` on ``stream``."""
    if _EVENT is None:
        event.record(stream)
    else:
        _EVENT.record(event, stream)


def wait(stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
    """Make ``stream``'s later work wait for ``event``."""
    if _EVENT is None:
        stream.wait_event(event)
    else:
        _EVENT.wait(event, stream)
