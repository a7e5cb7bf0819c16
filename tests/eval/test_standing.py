"""What the committed frontier runs say about a model and setting (esamp.eval.standing): read from
the run's report.json, never restated."""

import json

import pytest

from esamp.core.config import EsampConfig, Steering
from esamp.engines.models import EMBEDDED_NAME, PACKAGED
from esamp.eval import standing as standing_lib
from esamp.eval.standing import FRONTIER_RUNS, RESULTS, standing


def write_report(root, run="m/arith", vendi=(-0.27, -0.45, -0.10), gap=(-0.05, -0.09, -0.01, "below")):
    cell = {
        "settings": {"beta": 0.8, "mix": "paper", "train": True, "train_rows": "group", "lr": 0.001},
        "deltas": {"vendi": dict(zip(("delta", "low", "high"), vendi))},
    }
    report = {
        "task": "arith",
        "settings": {"n": 8},
        "cells": {"beta=0.8,mix=paper": cell},
        "frontier": {
            "problems": 20,
            "gaps": {"pass@1": {"beta=0.8,mix=paper": dict(zip(("gap", "low", "high", "verdict"), gap), outside=0.0)}},
        },
    }
    (root / run).mkdir(parents=True)
    (root / run / "report.json").write_text(json.dumps(report))


@pytest.fixture
def model(monkeypatch, tmp_path):
    monkeypatch.setitem(FRONTIER_RUNS, "tiny", "m/arith")
    write_report(tmp_path)
    return tmp_path


def test_a_setting_with_a_run_gets_its_figures_in_words(model):
    found = standing("tiny", Steering(), results=model)
    assert (found.cell, found.diversity, found.gap["verdict"], found.problems) == (
        "beta=0.8,mix=paper",
        "narrows",
        "below",
        20,
    )
    assert found.short() == (
        "measured on arith: Vendi −0.27 [−0.45, −0.10] (narrower), pass@1 below the "
        "temperature curve (−0.05 [−0.09, −0.01]); ? for more"
    )
    text = found.text()
    assert "narrows the samples (Vendi −0.27 [−0.45, −0.10]" in text
    assert "less accurate (pass@1) than plain sampling at the same diversity" in text
    assert "benchmarks/results/m/arith" in text and "sampling hotter or colder without ESamp" in text


def test_widening_and_beating_the_curve_read_so(tmp_path, monkeypatch):
    monkeypatch.setitem(FRONTIER_RUNS, "tiny", "m/arith")
    write_report(tmp_path, vendi=(0.2, 0.1, 0.3), gap=(0.04, 0.01, 0.07, "above"))
    found = standing("tiny", Steering(), results=tmp_path)
    assert found.diversity == "widens" and "beats plain sampling on pass@1" in found.text()
    assert "without ESamp does at least as well" not in found.text()


def test_a_cell_beyond_the_curve_is_not_compared_with_it(monkeypatch, tmp_path):
    """Past the diversity the temperature curve covers there is no gap: the words say so and draw
    no conclusion either way."""
    write_report(tmp_path, vendi=(-1.6, -1.9, -1.3), gap=(float("nan"), float("nan"), float("nan"), "outside"))
    monkeypatch.setitem(FRONTIER_RUNS, "tiny", "m/arith")
    found = standing("tiny", Steering(), results=tmp_path)
    assert "beyond the temperature curve's diversity" in found.short() and "n/a" not in found.short()
    assert "cannot compare its accuracy" in found.text()
    assert "does at least as well" not in found.text()


def add_shared_cell(results, vendi: float = -0.5) -> None:
    """The report ``write_report`` wrote, with the paper cell twice, as the Gemma run has it: a
    Distiller per group (``distiller: bank``) and the shared one (ΔVendi ``vendi``), listed first."""
    path = results / "m/arith/report.json"
    report = json.loads(path.read_text())
    bank = report["cells"].pop("beta=0.8,mix=paper")
    bank["settings"]["distiller"] = "bank"
    shared = {
        "settings": {**bank["settings"], "distiller": "shared"},
        "deltas": {"vendi": dict(bank["deltas"]["vendi"], delta=vendi)},
    }
    report["cells"] = {"beta=0.8,mix=paper,distiller=shared": shared, "beta=0.8,mix=paper": bank}
    gaps = report["frontier"]["gaps"]["pass@1"]
    gaps["beta=0.8,mix=paper,distiller=shared"] = gaps["beta=0.8,mix=paper"]
    path.write_text(json.dumps(report))


def test_of_cells_that_share_a_steering_the_engine_defaults_one_is_read(tmp_path, monkeypatch):
    """Of two cells with the same steering, the default settings read the engine's default (a
    Distiller per group), whichever cell the report lists first."""
    write_report(tmp_path)
    add_shared_cell(tmp_path)
    monkeypatch.setitem(FRONTIER_RUNS, "tiny", "m/arith")
    found = standing("tiny", Steering(), results=tmp_path)
    assert (found.cell, found.vendi["delta"]) == ("beta=0.8,mix=paper", -0.27)
    # an engine with the shared Distiller (the dashboard passes its own settings) reads that cell
    found = standing("tiny", Steering(), results=tmp_path, config=EsampConfig(distiller="shared"))
    assert (found.cell, found.vendi["delta"]) == ("beta=0.8,mix=paper,distiller=shared", -0.5)


def test_nothing_is_said_without_a_run_a_cell_or_a_file(model, tmp_path):
    assert standing("other", Steering(), results=model) is None
    assert standing("tiny", Steering(beta=1.2), results=model) is None  # no such cell
    assert standing("tiny", Steering(enabled=False), results=model) is None
    assert standing("tiny", Steering(), results=tmp_path / "nowhere") is None


@pytest.mark.parametrize("name", [EMBEDDED_NAME, "gemma3-270m"])
def test_each_model_with_a_committed_run_has_the_default_setting_in_it(name):
    """The dashboard's figure for the model comes from the committed report.json."""
    assert name == EMBEDDED_NAME or name in PACKAGED  # the name the engines report
    path = RESULTS / FRONTIER_RUNS[name] / "report.json"
    if not path.exists():
        pytest.skip("no committed frontier run here")
    found = standing(name, Steering())
    assert found is not None
    report = json.loads(path.read_text())
    assert found.vendi == report["cells"][found.cell]["deltas"]["vendi"]
    assert found.gap == report["frontier"]["gaps"][found.metric][found.cell]
    assert report["cells"][found.cell]["settings"].get("distiller", "bank") == "bank"
    assert standing_lib.RESULTS.name == "results"


def test_gemma_reads_the_run_in_the_completion_frame():
    """The earlier Gemma folder gave the base model the bare problem and measured continuations;
    the dashboard's note reads the run that prompted it in esamp eval's completion frame."""
    assert FRONTIER_RUNS["gemma3-270m"] == "eval-gpu-frontier-gemma3-270m-framed/arith"
    path = RESULTS / FRONTIER_RUNS["gemma3-270m"] / "report.json"
    if not path.exists():
        pytest.skip("no committed frontier run here")
    found = standing("gemma3-270m", Steering())
    assert (found.task, found.problems, found.n, found.cell) == ("arith", 40, 8, "beta=0.8,mix=paper")
    assert "completion frame" in (path.parent / "report.md").read_text(encoding="utf-8")
