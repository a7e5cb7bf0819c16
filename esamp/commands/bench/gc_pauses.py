"""Python's garbage collections in one process, counted while a pass runs: each pauses every
thread of that process. The bench counts them in the engine core's process (``esamp_gc`` of its
worker extension) and in its own, the client's, whose engines' outputs and step records wait for
it (a full collection of a client holding two engines took about 0.27 s on the CPU before the
engines froze its heap: ``esamp.engines.vllm.engine``)."""

from __future__ import annotations

import gc
import time


class GcPauses:
    """``start()`` counts from now; ``stop()`` stops counting and returns, per generation (its
    number as text), the collections, their seconds in all and the longest."""

    def __init__(self) -> None:
        self._callback = None
        self._seen: dict[int, dict] = {}

    def start(self) -> None:
        self.stop()
        seen: dict[int, dict] = {}
        began: list[float] = []

        def callback(phase: str, info: dict) -> None:
            if phase == "start":
                began.append(time.perf_counter())
            elif began:
                took = time.perf_counter() - began.pop()
                g = seen.setdefault(info["generation"], dict(collections=0, seconds=0.0, longest=0.0))
                g["collections"] += 1
                g["seconds"] += took
                g["longest"] = max(g["longest"], took)

        gc.callbacks.append(callback)
        self._callback, self._seen = callback, seen

    def stop(self) -> dict[str, dict] | None:
        """What was counted since ``start`` (None when not counting)."""
        if self._callback is None:
            return None
        gc.callbacks.remove(self._callback)
        self._callback = None
        return {str(g): dict(v) for g, v in self._seen.items()}


def totals(seen: dict[str, dict] | None) -> dict:
    """A count's collections, seconds and longest pause over every generation."""
    seen = seen or {}
    return dict(
        collections=sum(g["collections"] for g in seen.values()),
        seconds=round(sum(g["seconds"] for g in seen.values()), 6),
        longest_s=round(max((g["longest"] for g in seen.values()), default=0.0), 6),
        full=seen.get("2", {}).get("collections", 0),
    )
