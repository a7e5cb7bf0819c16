import json

import numpy as np
import pytest

from esamp.eval.diversity import diversity_summary, words
from esamp.eval.report import ascii_chart, render_markdown, summarize
from esamp.eval.runner import (
    RECORDS,
    EvalSettings,
    ResumeMismatch,
    prepare_out_dir,
    problem_seed,
    read_records,
    run_groups,
)
from esamp.eval.tasks import Problem

from .fake_engine import FakeEngine

PROBLEMS = [Problem(id=f"p{i}", kind="math", prompt=f"question {i}", answer="2") for i in range(6)]
PROBLEMS.append(Problem(id="story", kind="open", prompt="tell a story"))


def grade(problem, texts):
    if problem.kind != "math":
        return None
    return [
        {"correct": text.split()[-2] == problem.answer, "extracted": text.split()[-2], "note": ""} for text in texts
    ]


def measure(texts):
    vocab = sorted({w for t in texts for w in words(t)})
    bags = np.array([[words(t).count(w) for w in vocab] for t in texts], dtype=float)
    return diversity_summary(texts, bags)


def settings(**kw):
    base = dict(task="fake", problem_ids=[p.id for p in PROBLEMS], n=4, ks=[1, 2, 4], engine="fake")
    return EvalSettings(**{**base, **kw})


def run_all(out, engine, parallel=1):
    s = settings()
    prepare_out_dir(out, s)
    return run_groups(PROBLEMS, engine, s, out, grade, measure, parallel=parallel)


def stable(summary):
    """The summary without wall-clock figures, which differ between any two runs."""
    text = json.dumps(summary, sort_keys=True)
    data = json.loads(text)
    for arm in data["arms"].values():
        arm.pop("seconds"), arm.pop("tokens_per_s")
    return data


def test_both_arms_share_seeds_and_every_group_is_recorded(tmp_path):
    engine = FakeEngine()
    records = run_all(tmp_path, engine)
    assert len(records) == 2 * len(PROBLEMS)
    for p in PROBLEMS:
        base, steer = records[(p.id, "baseline")], records[(p.id, "esamp")]
        assert base["seed"] == steer["seed"] == problem_seed(0, p.id)
        assert len(base["texts"]) == 4 and all(t.endswith(".") for t in base["texts"])
    assert records[("story", "esamp")]["correct"] is None
    assert records[("story", "esamp")]["diversity"]["vendi"] >= 1.0
    assert len((tmp_path / RECORDS).read_text().splitlines()) == 2 * len(PROBLEMS)


def test_parallel_groups_give_the_same_records(tmp_path):
    one = run_all(tmp_path / "one", FakeEngine())
    many = run_all(tmp_path / "many", FakeEngine(), parallel=5)
    for key in one:
        assert one[key]["texts"] == many[key]["texts"]
        assert one[key]["correct"] == many[key]["correct"]


def test_resume_after_interrupt_matches_an_uninterrupted_run(tmp_path):
    s = settings()
    full = run_all(tmp_path / "full", FakeEngine())

    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        run_all(out, FakeEngine(interrupt_at_step=20))  # a group is 6 steps: stops inside group 4
    partial = read_records(out)
    assert 0 < len(partial) < len(full)

    again = FakeEngine()
    resumed = run_all(out, again)
    assert len(again.started) == len(full) - len(partial)  # only the missing groups ran
    assert {k: (r["texts"], r["correct"]) for k, r in resumed.items()} == {
        k: (r["texts"], r["correct"]) for k, r in full.items()
    }
    assert stable(summarize(PROBLEMS, resumed, s)) == stable(summarize(PROBLEMS, full, s))


def test_a_cut_off_last_line_is_dropped_and_rerun(tmp_path):
    run_all(tmp_path, FakeEngine())
    path = tmp_path / RECORDS
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # killed mid-write
    assert len(read_records(tmp_path)) == len(lines) - 1
    engine = FakeEngine()
    run_all(tmp_path, engine)
    assert len(engine.started) == 1
    assert len(read_records(tmp_path)) == len(lines)
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_a_broken_line_in_the_middle_is_an_error(tmp_path):
    run_all(tmp_path, FakeEngine())
    path = tmp_path / RECORDS
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = "{broken\n"
    path.write_text("".join(lines))
    with pytest.raises(Exception, match="line 2"):
        read_records(tmp_path)


def test_other_settings_in_the_same_folder_are_refused(tmp_path):
    prepare_out_dir(tmp_path, settings())
    with pytest.raises(ResumeMismatch, match="beta"):
        prepare_out_dir(tmp_path, settings(beta=0.3))


def test_summary_and_markdown(tmp_path):
    s = settings()
    records = run_all(tmp_path, FakeEngine())
    summary = summarize(PROBLEMS, records, s)
    assert summary["problems"] == {"asked": 7, "finished": 7, "graded": 6, "with_diversity": 7}
    for arm in ("baseline", "esamp"):
        info = summary["arms"][arm]
        assert info["pass@1"] <= info["pass@2"] <= info["pass@4"] <= 1.0
        assert info["correct"] == sum(records[(p.id, arm)]["correct"] for p in PROBLEMS[:6])
    for metric in ("pass@1", "pass@4", "vendi", "distinct_2"):
        d = summary["deltas"][metric]
        assert d["low"] <= d["delta"] <= d["high"]
        assert d["delta"] == pytest.approx(d["esamp"] - d["baseline"])
    md = render_markdown(summary, {"command": "esamp eval --task fake", "wall_seconds": 1.0})
    assert "| pass@1 |" in md and "## Pass@k against k" in md
    moved = [
        r for r in summary["per_problem"] if r["kind"] == "math" and r["baseline"]["correct"] != r["esamp"]["correct"]
    ]
    for r in moved:
        assert f"{r['baseline']['correct']}/4 → {r['esamp']['correct']}/4" in md


def test_ascii_chart_marks_both_arms():
    chart = ascii_chart([1, 2, 4], {"baseline": [0.0, 0.5, 1.0], "esamp": [0.0, 0.7, 1.0]})
    lines = chart.splitlines()
    assert lines[0].startswith(" 1.0 |") and lines[0].rstrip().endswith("*")  # both at 1.0
    assert "b" in chart and "E" in chart
    assert "1     2     4" in chart


def test_regrade_rewrites_verdicts_without_generating(tmp_path):
    from esamp.eval.runner import regrade

    before = run_all(tmp_path, FakeEngine())
    after = regrade(
        tmp_path,
        PROBLEMS,
        lambda p, texts: (
            None if p.kind == "open" else [{"correct": True, "extracted": None, "note": ""} for _ in texts]
        ),
    )
    assert set(after) == set(before)
    assert all(r["correct"] == 4 for r in read_records(tmp_path).values() if r["kind"] == "math")
    assert [r["texts"] for r in read_records(tmp_path).values()] == [r["texts"] for r in before.values()]
