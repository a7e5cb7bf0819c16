"""CUDA graphs of a steering step: captured once per shape, replayed from then on.

Speed machinery: a Distiller step is some seventy small kernels, bound by their launches on the
host; replaying it as one graph costs a few microseconds of host time instead of milliseconds.
The reference (eager) path is the same function called directly; GPU tests hold a replayed step
equal to eager steps.

``GraphCache.run(key, fn, *inputs)`` calls ``fn(*inputs)`` eagerly until the same ``key`` has
been seen ``after`` times (keys may alternate: the sampler's logits can come from two buffers in
turn), then captures it and replays it for every later call with that key. Graphs are kept per
key (``size`` of them, least recently used first out), so a shape that comes back replays at once.

Inputs are copied into the graph's own buffers before each replay, unless ``in_place=True``: then
the graph reads and writes the caller's tensors where they are, and the caller puts their
addresses into ``key`` (a tensor at another address is another graph). That serves fixed input
buffers (the steering plan's, the engine's tap rows) and inputs too large to copy every step,
such as the sampler's logits, which PyTorch's allocator hands out at the same address step after
step once a batch is steady. With ``shared_pool=True`` the cache's graphs share one memory pool:
they must then never run at the same time, and a graph's outputs are valid until the next replay
of any graph of the cache. The pool lives as long as one of its graphs does: once the last is gone
(evicted, or the cache cleared) PyTorch releases it, and a capture into the released pool's handle
fails an allocator assert ("use_count > 0"), so a capture into an empty cache takes a new handle.

Every capture, and the first eager call, runs on one side stream kept for captures. A capture
needs the libraries it calls to be initialised on its stream beforehand (cuBLAS fails with
CUBLAS_STATUS_NOT_INITIALIZED when a graph's first matmul meets a cold stream), which is what
the first eager call does, as PyTorch's capture recipe prescribes. A capture that fails anyway
turns graphs off for the rest of the run (``failures`` counts it); eager steps go on.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Hashable

import torch

from esamp.core.backends import streams

log = logging.getLogger(__name__)

GRAPH_AFTER = 2  # eager steps of an unchanged shape before capturing (short-lived shapes are not worth one)
GRAPH_CACHE = 4  # captured shapes kept


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


class _Graph:
    """One captured call: static inputs in, static outputs back (overwritten by the next replay)."""

    def __init__(
        self,
        fn: Callable,
        inputs: tuple[torch.Tensor, ...],
        stream: torch.cuda.Stream,
        in_place: bool = False,
        pool=None,
    ) -> None:
        # In place: no reference to the caller's tensors is kept (their memory must stay free to
        # be handed out again at the same address); the key names the addresses.
        self.inputs = () if in_place else tuple(t.clone() for t in inputs)
        captured = inputs if in_place else self.inputs
        self.graph = torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream()
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                self.outputs = fn(*captured)
            finally:
                self.graph.capture_end()
        main.wait_stream(stream)

    def replay(self, inputs: tuple[torch.Tensor, ...]):
        for static, value in zip(self.inputs, inputs):
            static.copy_(value)
        self.graph.replay()
        return self.outputs


class GraphCache:
    def __init__(
        self,
        enabled: bool = True,
        after: int = GRAPH_AFTER,
        size: int = GRAPH_CACHE,
        in_place: bool = False,
        shared_pool: bool = False,
    ) -> None:
        self.enabled = enabled
        self.in_place = in_place
        self.after, self.size = after, size
        self.shared_pool = shared_pool
        self.graphs: collections.OrderedDict[Hashable, _Graph] = collections.OrderedDict()
        self.captures = self.failures = self.replays = self.eager = 0
        self.capture_seconds = 0.0  # host time spent capturing (a cost paid once per shape)
        self._seen: dict[Hashable, int] = {}  # eager calls per key not captured yet
        self._stream: torch.cuda.Stream | None = None
        self._pool = None
        self._warm = False

    def run(self, key: Hashable, fn: Callable, *inputs: torch.Tensor):
        """``fn(*inputs)``, eagerly or by replaying the graph captured for ``key``."""
        if not self.enabled:
            return fn(*inputs)
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            self.replays += 1
            return graph.replay(inputs)
        if len(self._seen) > 256:  # keys that never came back
            self._seen.clear()
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if seen <= self.after or not self._warm:
            self.eager += 1
            return self._on_stream(fn, inputs)
        graph = self._capture(key, fn, inputs)
        if graph is None:
            return fn(*inputs)
        return graph.replay(inputs)

    def prepare(self, key: Hashable, fn: Callable, *inputs: torch.Tensor) -> bool:
        """Capture ``key`` now, before its first step: one eager call (it compiles what ``fn``
        launches, which a capture cannot, and warms the capture stream), then the capture. False
        when graphs are off or the capture failed (graphs then stay off, as in ``run``)."""
        if not self.enabled:
            return False
        if key in self.graphs:
            return True
        self._on_stream(fn, inputs)
        return self._capture(key, fn, inputs) is not None

    def _capture(self, key: Hashable, fn: Callable, inputs: tuple) -> _Graph | None:
        while len(self.graphs) >= self.size:
            self.graphs.popitem(last=False)  # the least recently used graph and its memory go
        t0 = time.perf_counter()
        try:
            # Captured under the caller's inference mode: a step that needs autograd turns it off
            # itself (the Distiller's), and one that writes the sampler's logits in place needs it on.
            if self.shared_pool and (self._pool is None or not self.graphs):
                self._pool = torch.cuda.graph_pool_handle()  # a pool goes with its last graph (module docstring)
            graph = _Graph(fn, inputs, self.stream, self.in_place, self._pool)
        except Exception as exc:  # an optimisation must never take the engine down
            self.enabled = False
            self.graphs.clear()
            self.failures += 1
            log.warning("ESamp: capturing a step as a CUDA graph failed (%s); continuing without graphs", exc)
            return None
        self.capture_seconds += time.perf_counter() - t0
        self.graphs[key] = graph
        self._seen.pop(key, None)
        self.captures += 1
        return graph

    @property
    def stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _on_stream(self, fn: Callable, inputs: tuple):
        """An eager call on the capture stream (warming it), ordered with the current stream."""
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            out = fn(*inputs)
        main.wait_stream(self.stream)
        for t in _tensors(out):
            t.record_stream(main)  # allocated on the side stream, read on the main one
        self._warm = True
        return out


class SideStream:
    """Work launched beside the current stream, on a stream of its own: ``run`` queues a call
    (replayed from its own ``GraphCache``) after everything the current stream has queued so far
    and returns the CUDA event of its end. Nothing waits for it here: whoever owns what it writes
    makes the next reader wait for that event (``DistillerBank.settle`` for the Distiller's update,
    which so runs beside the mix, the sampler and the model's next forward)."""

    def __init__(self, graphs: GraphCache) -> None:
        self.graphs = graphs
        self._stream: torch.cuda.Stream | None = None
        # Two events, reused (a step's host time is a few driver calls; creating two events a step
        # was two more): ``queued`` orders the side stream after the current one, ``done`` marks the
        # end of the latest call. Recording an event again affects no wait already queued on it,
        # and every call is queued on the same side stream after the previous one, so a reader
        # that waits for the latest ``done`` waits for all of them.
        self._queued: torch.cuda.Event | None = None
        self._done: torch.cuda.Event | None = None
        self._device = 0  # the CUDA device of the current stream at the first call

    def run(self, key: Hashable, fn: Callable, *inputs: torch.Tensor, graphed: bool = True) -> torch.cuda.Event:
        """``fn(*inputs)`` beside the current stream, replayed from a graph unless ``graphed`` is
        False (inputs at new addresses every call, e.g. from a step that is not a graph itself:
        one capture per call would cost more than it saves). Returns the event of its end, valid
        until the next call (the next call records it again). The stream calls are ``streams``'
        (a steady step makes this call every step)."""
        if self._stream is None:
            self._device = torch.cuda.current_device()
            self._stream = torch.cuda.Stream()
            self._queued, self._done = torch.cuda.Event(), torch.cuda.Event()
        side = self._stream
        main = streams.current(self._device)
        streams.record(self._queued, main)
        streams.wait(side, self._queued)
        streams.switch(side)
        try:
            if graphed:
                self.graphs.run(key, fn, *inputs)
            else:
                fn(*inputs)
            streams.record(self._done, side)
        finally:
            streams.switch(main)
        if not graphed:  # (a graph's inputs are buffers that live as long as it)
            for t in inputs:
                t.record_stream(side)  # an eager input's memory is not reused before this reads it
        return self._done


class PriorityLane:
    """Work the current stream waits for, run on a stream of the device's highest priority: ``run``
    queues a call (a graph's replay: it allocates nothing) after everything the current stream has
    queued so far, and makes the current stream's later work wait for its end. The GPU's block
    scheduler starts a waiting kernel of a higher-priority stream first as blocks finish, so the
    call's kernels do not queue behind the blocks of work beside them on a stream of normal
    priority (the Distiller's update, ``SideStream``) as the current stream's would; the work
    beside fills what they leave free. The stream calls are ``streams``' (a steady step makes this
    call every step)."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None
        self._queued: torch.cuda.Event | None = None  # reused, as ``SideStream``'s
        self._done: torch.cuda.Event | None = None
        self._device = 0
        self.runs = 0

    def run(self, fn: Callable, *args):
        """``fn(*args)`` on the lane, ordered after the current stream's work and before its next."""
        if self._stream is None:
            self._device = torch.cuda.current_device()
            # (a priority past the device's range is taken as the nearest it has: its highest)
            self._stream = torch.cuda.Stream(priority=-(1 << 10))
            self._queued, self._done = torch.cuda.Event(), torch.cuda.Event()
        lane = self._stream
        main = streams.current(self._device)
        streams.record(self._queued, main)
        streams.wait(lane, self._queued)
        streams.switch(lane)
        try:
            out = fn(*args)
            streams.record(self._done, lane)
        finally:
            streams.switch(main)
        streams.wait(main, self._done)
        self.runs += 1
        return out
