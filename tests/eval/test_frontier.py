"""The diversity–accuracy frontier: the temperature curve, each point's gap to it with a paired
bootstrap interval, the verdict in words, the plot; synthetic numbers and the scripted engine."""

import importlib.util
import json

import numpy as np
import pytest

from esamp.eval import frontier
from esamp.eval.frontier import analyse, curve_value, temperature_at

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (the eval extra)"
)


def test_the_curve_is_read_between_its_points_and_nowhere_else():
    xs, ys = np.array([1.0, 2.0, 3.0]), np.array([0.6, 0.4, 0.2])
    assert curve_value(xs, ys, np.array(1.5)) == pytest.approx(0.5)
    assert curve_value(xs, ys, np.array(3.0)) == pytest.approx(0.2)
    assert np.isnan(curve_value(xs, ys, np.array(3.5))) and np.isnan(curve_value(xs, ys, np.array(0.5)))
    # folded back (Vendi fell from T2 to T3): the highest pass@k at a Vendi counts
    assert curve_value(np.array([1.0, 3.0, 2.0]), np.array([0.5, 0.4, 0.2]), np.array(2.5)) == pytest.approx(0.425)
    # resamples broadcast
    both = curve_value(np.stack([xs, xs + 1]), np.stack([ys, ys]), np.array([1.5, 1.5]))
    assert both[0] == pytest.approx(0.5) and np.isnan(both[1])


def test_the_temperature_as_diverse_is_interpolated_on_the_first_crossing():
    assert temperature_at([2.0, 2.5, 3.0], [0.4, 0.8, 1.2], 2.75) == pytest.approx(1.0)
    assert temperature_at([2.0, 2.5, 3.0], [0.4, 0.8, 1.2], 3.5) is None


def synthetic(cell_pass: float, cell_vendi: float = 2.5, problems: int = 60, noise: float = 0.02):
    """A falling curve pass = 1.4 - 0.4 * Vendi at T 0.4 .. 1.6, one cell at (cell_vendi, cell_pass)."""
    rng = np.random.default_rng(1)
    curve = {"baseline": 0.8, "t0.4": 0.4, "t1.2": 1.2, "t1.6": 1.6}
    vendi_at = {"t0.4": 2.0, "baseline": 2.4, "t1.2": 2.8, "t1.6": 3.2, "cell": cell_vendi}
    vendi = {a: v + rng.normal(0, noise, problems) for a, v in vendi_at.items()}
    passes = {a: np.clip(1.4 - 0.4 * v + rng.normal(0, noise, problems), 0, 1) for a, v in vendi_at.items()}
    passes["cell"] = np.clip(cell_pass + rng.normal(0, noise, problems), 0, 1)
    return analyse(curve, vendi, {"pass@1": passes}, resamples=2000)


@pytest.mark.parametrize("cell_pass, expected", [(0.6, "above"), (0.2, "below"), (0.4, "on")])
def test_a_cell_is_above_below_or_on_the_curve_by_its_interval(cell_pass, expected):
    out = synthetic(cell_pass)  # the curve is at 0.4 where the cell's Vendi is 2.5
    gap = out["gaps"]["pass@1"]["cell"]
    assert gap["verdict"] == expected
    assert gap["low"] <= gap["gap"] <= gap["high"]
    assert gap["gap"] == pytest.approx(cell_pass - 0.4, abs=0.02)
    assert out["curve"] == ["t0.4", "baseline", "t1.2", "t1.6"]
    assert out["temperature_equivalent"]["cell"] == pytest.approx(0.9, abs=0.05)


def test_a_cell_beyond_the_curve_gets_no_verdict_but_outside():
    out = synthetic(0.9, cell_vendi=3.6)
    assert out["gaps"]["pass@1"]["cell"]["verdict"] == frontier.OUTSIDE
    assert out["temperature_equivalent"]["cell"] is None
    edge = synthetic(0.9, cell_vendi=3.19, noise=0.05)  # at the curve's end: many resamples fall off it
    assert edge["gaps"]["pass@1"]["cell"]["outside"] > frontier.EDGE
    assert edge["gaps"]["pass@1"]["cell"]["verdict"] == frontier.OUTSIDE


def test_the_bootstrap_is_seeded_and_the_interval_widens_with_noise():
    assert synthetic(0.5) == synthetic(0.5)
    calm, loud = synthetic(0.5, noise=0.01), synthetic(0.5, noise=0.08)
    width = lambda out: out["gaps"]["pass@1"]["cell"]["high"] - out["gaps"]["pass@1"]["cell"]["low"]  # noqa: E731
    assert width(loud) > 2 * width(calm)


# -- on the scripted engine, end to end ------------------------------------------------------

from esamp.core.config import EsampConfig, SamplingConfig  # noqa: E402
from esamp.eval.matrix import build_cells, build_plain_arms, parse_axes, validate_axes  # noqa: E402
from esamp.eval.report import render_markdown, summarize  # noqa: E402
from esamp.eval.runner import EvalSettings, prepare_out_dir, run_groups  # noqa: E402
from esamp.eval.tasks import Problem  # noqa: E402

from .fake_engine import FakeEngine  # noqa: E402
from .test_runner import grade, measure  # noqa: E402

MATH = [Problem(id=f"m{i}", kind="math", prompt=f"q {i}", answer="2") for i in range(10)]
OPEN = [Problem(id=f"o{i}", kind="open", prompt=f"story {i}") for i in range(5)]


def run(
    tmp_path, problems, plain=(["temperature=0.4,1.2,1.6"], ["temperature=1.5", "top_p=1", "min_p=0.1"]), diversity=True
):
    base = SamplingConfig(n=8)
    arms = [a for spec in plain for a in build_plain_arms([parse_axes(spec, "--plain")], base)]
    cells = build_cells(validate_axes(parse_axes(["beta=0.4,1.2"]), EsampConfig()), EsampConfig())
    s = EvalSettings(
        task="t", problem_ids=[p.id for p in problems], engine="fake", sampling=base, cells=cells, plain=arms
    )
    prepare_out_dir(tmp_path, s)
    records = run_groups(problems, FakeEngine(), s, tmp_path, grade, measure if diversity else (lambda t: None))
    return summarize(problems, records, s, resamples=500)


def test_the_report_says_where_every_cell_stands(tmp_path):
    summary = run(tmp_path, MATH)
    front = summary["frontier"]
    assert front["curve"] == ["temperature=0.4", "baseline", "temperature=1.2", "temperature=1.6"]
    assert set(front["gaps"]) == {"pass@1", "pass@8"}
    # every arm off the curve gets a gap: the cells and the min-p arm
    assert set(front["gaps"]["pass@1"]) == {"beta=0.4", "beta=1.2", "temperature=1.5,top_p=1.0,min_p=0.1"}
    md = render_markdown(summary, {})
    section = md[md.index("## Against the temperature curve") : md.index("## Totals")]
    assert "plain sampling at T 0.4, 0.8 (the baseline), 1.2, 1.6" in section
    for metric in ("pass@1", "pass@8"):
        by = frontier.standing(front, metric, ["beta=0.4", "beta=1.2"])
        if by["above"]:
            assert f"On {metric}, {len(by['above'])} of 2 ESamp cells lie above the temperature curve" in section
        else:
            assert f"On {metric}, no ESamp cell lies above the temperature curve" in section
    assert "Plain temperature=1.5,top_p=1.0,min_p=0.1:" in section
    assert "| temperature=1.2 | 1.2 |" in section and "(curve)" in section
    json.dumps(summary)  # the report.json stays JSON (no NaN objects it cannot hold)


def test_an_open_task_reads_diversity_as_a_temperature(tmp_path):
    summary = run(tmp_path, OPEN)
    front = summary["frontier"]
    assert front["gaps"] == {} and set(front["temperature_equivalent"]) >= {"beta=0.4", "beta=1.2"}
    md = render_markdown(summary, {})
    assert "no accuracy axis" in md and "as diverse as T" in md


def test_no_curve_without_a_second_temperature_or_without_vendi(tmp_path):
    assert "frontier" not in run(tmp_path / "a", MATH, plain=(["top_p=0.5"],))
    assert "frontier" not in run(tmp_path / "b", MATH, diversity=False)


@needs_matplotlib
def test_the_frontier_plot_is_drawn_and_embedded(tmp_path):
    from esamp.eval.html import markdown_to_html
    from esamp.eval.plots import write_plots

    summaries = [run(tmp_path / "m", MATH), run(tmp_path / "o", OPEN)]
    summaries[1]["task"] = "o"
    images, problem = write_plots(summaries, tmp_path)
    assert (
        problem is None and images["t"]["frontier"] == "t-frontier.png" and images["o"]["frontier"] == "o-frontier.png"
    )
    for name in ("t-frontier.png", "o-frontier.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / name).stat().st_size > 5000
    md = render_markdown(summaries[0], {}, images["t"])
    assert "](t-frontier.png)" in md
    assert markdown_to_html(md, tmp_path).count("data:image/png;base64,") == 5  # with the learning plot
