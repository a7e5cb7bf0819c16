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
