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


def test_a_pass_reports_this_processs_full_collections_and_combines_them():
    """The client's own collections in a pass (a full one of a client holding two engines took
    about 0.27 s on the CPU before the engines froze its heap): counted beside the engine's, summed
    over a trial's passes, the longest kept."""
    from esamp.commands.bench.trials import combine
    from esamp.core.config import Steering

    class Collecting(_Engine):
        def has_unfinished(self) -> bool:
            gc.collect()  # a full collection in this process, inside the pass
            return False

    callbacks = len(gc.callbacks)
    passes = [run_trial(Collecting(), ["p"], 1, 1, {}, Steering()) for _ in range(2)]
    assert len(gc.callbacks) == callbacks  # the count stops with the pass
    for p in passes:
        assert p["client_gc_full"] == 1 and p["client_gc_collections"] >= 1
        assert 0 < p["client_gc_longest_s"] <= p["client_gc_seconds"]
        assert p["gc_collections"] == 0  # no worker extension: the engine's are not counted
    trial = combine(passes)
    assert trial["client_gc_full"] == 2
    assert trial["client_gc_longest_s"] == max(p["client_gc_longest_s"] for p in passes)


def test_a_pass_whose_group_failed_stops_the_bench_with_the_groups_error():
    """A group that fails ends with an error event and its samples aborted short: the pass would
    count fewer tokens than its workload asks and read as a faster or slower side. It raises."""
    from esamp.core.config import Steering
    from esamp.errors import EngineError
    from esamp.events import ErrorEvent

    class Failing(_Engine):
        def has_unfinished(self) -> bool:
            return bool(self.started)

        def step(self):
            self.started.clear()
            return [ErrorEvent(message="generation failed: boom", group="g", hint="the other groups keep running")]

    callbacks = len(gc.callbacks)
    with pytest.raises(EngineError, match="a bench pass failed: generation failed: boom"):
        run_trial(Failing(), ["p"], 1, 1, {}, Steering())
    assert len(gc.callbacks) == callbacks  # the pass's count of this process's collections stopped too


def test_a_pass_asks_every_group_to_run_past_its_stop_token():
    """The bench counts a pass's tokens from its groups' done events: a group whose stream ended at
    its stop token would count fewer than the engine decoded (the engine itself runs past it), so
    each pass's groups ignore EOS as well."""
    from esamp.core.config import Steering

    seen = []

    class Recording(_Engine):
        def start(self, prompt, sampling, steering) -> None:
            seen.append(sampling)

    run_trial(Recording(), ["p", "q"], 2, 6, {"temperature": 0.8}, Steering())
    assert [(s.ignore_eos, s.n, s.max_tokens, s.temperature) for s in seen] == [(True, 2, 6, 0.8)] * 2
