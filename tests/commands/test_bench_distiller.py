"""``esamp bench --distiller shared``: the ESamp side runs the shared Distiller, and the JSON says so."""

from __future__ import annotations

import argparse
import importlib

import pytest

from esamp.commands.bench import memory

bench = importlib.import_module("esamp.commands.bench.run")  # the package re-exports run() under this name
GIB = 1024**3


@pytest.fixture(autouse=True)
def _machine(tmp_path, monkeypatch):
    monkeypatch.setenv("ESAMP_CACHE_DIR", str(tmp_path))  # the presets write their config.json here
    monkeypatch.setattr(memory, "_memory_source", lambda: ("ram", 128 * GIB, 100 * GIB))


def _plan(*argv: str):
    p = argparse.ArgumentParser()
    bench.configure(p)
    return bench._plan(p.parse_args(["--model", "qwen2.5-0.5b:dummy", "--workloads", "4x32", *argv]))


def test_the_esamp_side_takes_the_distiller_flag_and_records_it():
    shared = _plan("--distiller", "shared", "--slots", "4").esamp
    assert shared.distiller == "shared" and shared.flat()["distiller"] == "shared"  # the JSON's "esamp"
    assert _plan().esamp.distiller == "bank"


@pytest.mark.parametrize("gpu", [True, False])
def test_the_plan_sizes_the_engines_for_the_widest_workload_and_keeps_the_spread_target(monkeypatch, gpu):
    """The engines take every row of the widest workload at once (max_num_seqs), and the spread
    target is --spread's default for the machine: each its own field (once swapped by position,
    which capped a GPU bench's engines at 16 sequences)."""
    from esamp.commands.bench.workloads import SPREAD_TARGET
    from esamp.platform import devices

    monkeypatch.setattr(devices, "cuda_available", lambda: gpu)
    plan = _plan("--workloads", "4x32,fair,32xn8x256")
    assert plan.max_seqs == 32 * 8
    assert plan.spread == (SPREAD_TARGET if gpu else 0.0)
    assert _plan("--spread", "0.05").spread == 0.05
