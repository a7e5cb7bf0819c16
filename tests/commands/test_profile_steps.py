"""``benchmarks/profile_steps.py`` reading a trace step by step: each device event goes to the
engine step whose host annotation launched it, and per-step figures divide by the steps the trace
holds (vLLM's profiler may stop a step early)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_steps.py"


@pytest.fixture(scope="module")
def profile_steps():
    before = dict(os.environ)
    spec = importlib.util.spec_from_file_location("profile_steps", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert dict(os.environ) == before  # importing it sets nothing for the engines of later tests
    return module


def _trace(steps: list[dict]) -> dict:
    """A trace of engine steps: per step the annotation's start and length, and its kernels as
    (launched at, starts at, lasts, stream)."""
    events, corr = [], 0
    for step in steps:
        events.append(
            dict(
                ph="X",
                cat="user_annotation",
                name="execute_context_0(0)_generation_8(8)",
                ts=step["at"],
                dur=step["host"],
            )
        )
        for launch, start, dur, stream in step["kernels"]:
            corr += 1
            events.append(
                dict(ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=launch, dur=1, args=dict(correlation=corr))
            )
            events.append(
                dict(
                    ph="X", cat="kernel", name=f"k{stream}", tid=stream, ts=start, dur=dur, args=dict(correlation=corr)
                )
            )
    return dict(traceEvents=events)


TRACE = _trace(
    [
        # step 0: main stream 100..400 and 450..500, a side-stream kernel 300..420
        dict(at=0, host=60, kernels=[(10, 100, 300, 7), (20, 300, 120, 21), (50, 450, 50, 7)]),
        # step 1 starts 600: the main stream waited 100 us for it (its last kernel ended at 500)
        dict(at=550, host=40, kernels=[(560, 600, 200, 7)]),
        # step 2: the last, no period
        dict(at=900, host=30, kernels=[(910, 950, 100, 7)]),
    ]
)


def test_each_step_gets_the_kernels_its_host_launched(profile_steps):
    rows = profile_steps.step_periods(TRACE)
    assert [r["period_us"] for r in rows] == [500.0, 350.0, None]
    assert [r["main_us"] for r in rows] == [350.0, 200.0, 100.0]
    assert [r["other_us"] for r in rows] == [120.0, 0.0, 0.0]
    assert [r["gap_us"] for r in rows] == [100.0, 150.0, None]
    assert [r["host_ms"] for r in rows] == [0.06, 0.04, 0.03]
    assert profile_steps._period_medians(rows) == dict(
        period_us=425.0, main_us=275.0, other_us=60.0, gap_us=125.0, host_ms=0.05
    )


def test_per_step_figures_divide_by_the_steps_the_trace_holds(profile_steps):
    summary = profile_steps.summarize_trace(TRACE, steps=8)  # asked for 8, the trace holds 3
    assert summary["window"]["steps"] == 3
    assert summary["window"]["busy_us_per_step"] == pytest.approx(
        (320 + 50 + 200 + 100) / 3, abs=0.1
    )  # the union of every stream
    assert summary["period"]["period_us"] == 425.0


def test_a_trace_without_annotations_keeps_the_asked_steps(profile_steps):
    plain = dict(traceEvents=[e for e in TRACE["traceEvents"] if e["cat"] != "user_annotation"])
    assert profile_steps.step_periods(plain) == []
    summary = profile_steps.summarize_trace(plain, steps=8)
    assert summary["window"]["steps"] == 8 and summary["period"] is None


def test_a_trace_that_cannot_be_read_is_named(profile_steps, tmp_path, capsys):
    bad = tmp_path / "notes.json"
    bad.write_text("not json")
    for path in (str(tmp_path / "missing.json.gz"), str(bad)):
        assert profile_steps.print_periods([path]) == 2
        assert f"--periods {path}: not a readable trace" in capsys.readouterr().out


def test_the_comparison_writes_what_esamp_adds_per_step(profile_steps, tmp_path, capsys):
    """``--compare`` with ``--compare-json``: the added kernel time and launches per step (each side
    divided by its own traced steps), as the README's trace figure reads them."""
    import json

    def summary(side, steps, kernels):
        return dict(side=side, step_ms_median=8.0, window=dict(steps=steps, busy_us_per_step=1.0), kernels=kernels)

    base = tmp_path / "base.json"
    esamp = tmp_path / "esamp.json"
    base.write_text(json.dumps(summary("baseline", 2, {"gemm": [2, 1000.0], "softmax": [2, 200.0]})))
    esamp.write_text(json.dumps(summary("esamp", 4, {"gemm": [4, 2200.0], "distill": [8, 80.0]})))
    out = tmp_path / "added.json"
    assert profile_steps.compare(str(base), str(esamp), top=5, out=str(out)) == 0
    added = json.loads(out.read_text())
    # per step: gemm 550 − 500, softmax −100, distill +20 → −30 us; launches 1 − 1 − 1 + 2 = +1
    assert added["added_kernel_ms_per_step"] == pytest.approx(-0.03)
    assert added["added_launches_per_step"] == pytest.approx(1.0)
    assert {k["name"] for k in added["kernels"]} == {"gemm", "softmax", "distill"}
    assert "ESamp minus baseline" in capsys.readouterr().out


def test_idle_gaps_name_the_late_launch(profile_steps):
    """A wait of the main stream is put between the kernels around it, with how late the host launched the
    second one; waits shorter than the threshold and other streams' kernels are left out."""
    rows = profile_steps.idle_gaps(TRACE, min_us=40)
    # main stream (tid 7): waits 400..450 (its next kernel launched at 50: 350 us early), 500..600 (launched
    # at 560: 60 us late) and 800..950 (launched at 910: 110 us late)
    got = {(r["before"], r["after"]): (r["count"], r["idle_us"], r["late_us_median"]) for r in rows}
    assert got == {("k7", "k7"): (3, 50.0 + 100.0 + 150.0, 60.0)}
    assert rows[0]["call"] == "cudaLaunchKernel"
