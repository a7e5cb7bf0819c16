"""The bench worker extension's host profile (what ``benchmarks/profile_host.py`` reads from each
tensor-parallel worker): it profiles the thread that calls it, from start to stop."""

from __future__ import annotations

import pytest

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
