"""The bench worker extension's host profile (what ``benchmarks/profile_host.py`` reads from each
tensor-parallel worker): it profiles the thread that calls it, from start to stop; and its count of
the worker process's garbage collections, which each pass of ``esamp bench`` reports."""

from __future__ import annotations

import gc

import pytest

from esamp.commands.bench.trials import run_trial
from esamp.commands.bench.worker_extension import EsampBenchExtension


def _busy_step_of_a_worker() -> int:
    return sum(i * i for i in range(20_000))


def test_a_workers_host_profile_names_what_its_thread_ran():
    worker = object.__new__(EsampBenchExtension)  # the mixin alone: vLLM's worker adds the rest
    assert worker.esamp_host_profile("stop") is None  # nothing started
    assert worker.esamp_host_profile("start") is None
    _busy_step_of_a_worker()
    text = worker.esamp_host_profile("stop", 10)
    assert "_busy_step_of_a_worker" in text and "function calls" in text
    assert worker.esamp_host_profile("stop") is None  # one profile per start
    with pytest.raises(ValueError, match="'start' or 'stop'"):
        worker.esamp_host_profile("pause")


def test_a_workers_garbage_collections_are_counted_from_start_to_stop():
    worker = object.__new__(EsampBenchExtension)
    assert worker.esamp_gc("stop") is None  # nothing started
    callbacks = len(gc.callbacks)
    assert worker.esamp_gc("start") is None
    assert worker.esamp_gc("start") is None  # a second start counts afresh, with one callback
    assert len(gc.callbacks) == callbacks + 1
    gc.collect()
    seen = worker.esamp_gc("stop")
    assert seen["2"]["collections"] >= 1 and 0 <= seen["2"]["longest"] <= seen["2"]["seconds"]
    assert len(gc.callbacks) == callbacks and worker.esamp_gc("stop") is None
    with pytest.raises(ValueError, match="'start' or 'stop'"):
        worker.esamp_gc("pause")


class _Engine:
    """An engine that finishes at once, with the bench's extension as its one worker."""

    def __init__(self, worker=None) -> None:
        self.worker = worker
        self.started = []

    def start(self, prompt, sampling, steering) -> None:
        self.started.append(prompt)

    def has_unfinished(self) -> bool:
        if self.worker is not None and len(self.started) == 1:
            self.started.append(gc.collect())  # a collection inside the pass
        return False

    def drain(self) -> dict:
        return {}


def test_a_pass_reports_the_engine_processs_collections():
    from esamp.core.config import Steering

    plain = run_trial(_Engine(), ["p"], 1, 1, {}, Steering())
    assert (plain["gc_collections"], plain["gc_seconds"]) == (0, 0.0)  # no extension: nothing counted
    engine = _Engine(object.__new__(EsampBenchExtension))
    engine.workers = lambda method, *args: [getattr(engine.worker, method)(*args)]
    counted = run_trial(engine, ["p"], 1, 1, {}, Steering())
    assert counted["gc_collections"] >= 1 and counted["gc_longest_s"] <= counted["gc_seconds"]
