"""Plain arms: plain sampling at other filters (a temperature sweep, min-p at high temperature)
beside the cells, on the same problems and seeds, ESamp off, resumable like cells."""

import json

import pytest

from esamp.commands.cli import main
from esamp.core.config import EsampConfig, SamplingConfig
from esamp.errors import ConfigError
from esamp.eval.matrix import build_cells, build_plain_arms, parse_axes
from esamp.eval.runner import (
    EvalSettings,
    ResumeMismatch,
    prepare_out_dir,
    problem_seed,
    run_groups,
    with_recorded_cells,
)

from .fake_engine import FakeEngine
from .test_cli_matrix import engines, needs_math_verify, task_file  # noqa: F401 (engines: a fixture)
from .test_matrix import PROBLEMS
from .test_runner import grade, measure

BASE = SamplingConfig(n=4)


def plain_of(*specs, base=BASE):
    return [arm for spec in specs for arm in build_plain_arms([parse_axes(list(spec), "--plain")], base)]


def settings(plain, cells=None, **kw):
    return EvalSettings(
        task="fake",
        problem_ids=[p.id for p in PROBLEMS],
        ks=[1, 2, 4],
        engine="fake",
        cells=cells or build_cells({}, EsampConfig()),
        sampling=BASE,
        plain=plain,
        **kw,
    )


def test_plain_arms_are_named_by_what_they_set_and_each_spec_is_a_cross_product():
    arms = plain_of(["temperature=0.4,1.2"], ["temperature=1.5,2", "top_p=1", "min_p=0.1"])
    assert [a.name for a in arms] == [
        "temperature=0.4",
        "temperature=1.2",
        "temperature=1.5,top_p=1.0,min_p=0.1",
        "temperature=2.0,top_p=1.0,min_p=0.1",
    ]
    hot = arms[2].sampling(BASE)
    assert (hot.temperature, hot.top_p, hot.min_p, hot.n, hot.max_tokens) == (1.5, 1.0, 0.1, 4, BASE.max_tokens)


def test_plain_arms_sample_without_esamp_at_their_own_filters_on_the_shared_seeds(tmp_path):
    s = settings(plain_of(["temperature=0.4,1.6"]))
    assert s.arms == ["baseline", "temperature=0.4", "temperature=1.6", "esamp"]
    prepare_out_dir(tmp_path, s)
    engine = FakeEngine()
    started = []
    real_start = engine.start
    engine.start = lambda prompt, sampling, esamp=None, group=None, chat=True: (
        started.append((group, sampling, esamp)) or real_start(prompt, sampling, esamp, group, chat)
    )
    records = run_groups(PROBLEMS, engine, s, tmp_path, grade, measure)
    assert len(records) == 4 * len(PROBLEMS)
    for group, sampling, steering in started:
        problem, arm = group.split("|")
        assert sampling.seed == problem_seed(0, problem)
        assert sampling.temperature == {"temperature=0.4": 0.4, "temperature=1.6": 1.6}.get(arm, BASE.temperature)
        assert steering.enabled == (arm == "esamp")
    # the fake engine's hotter arm reaches answers the colder never gives
    answers = {
        arm: {t.split()[-2] for p in PROBLEMS for t in records[(p.id, arm)]["texts"]}
        for arm in ("temperature=0.4", "temperature=1.6")
    }
    assert answers["temperature=0.4"] < answers["temperature=1.6"]


def test_plain_arms_added_to_a_finished_folder_sample_only_themselves(tmp_path):
    first = settings([])
    prepare_out_dir(tmp_path, first)
    run_groups(PROBLEMS, FakeEngine(), first, tmp_path, grade, measure)
    second = settings(plain_of(["temperature=1.2"]))
    assert prepare_out_dir(tmp_path, second) == ["temperature=1.2"]
    engine = FakeEngine()
    run_groups(PROBLEMS, engine, second, tmp_path, grade, measure)
    assert {k.split("|")[1] for k in engine.started} == {"temperature=1.2"}
    # a later run without --plain still reports the folder's plain arm
    merged = with_recorded_cells(settings([]), tmp_path)
    assert [a.name for a in merged.plain] == ["temperature=1.2"] and merged.arms[1] == "temperature=1.2"
    run = json.loads((tmp_path / "run.json").read_text())["settings"]
    assert run["plain"] == {"temperature=1.2": {"temperature": 1.2}}


def test_a_plain_arm_of_the_same_name_with_other_settings_is_refused(tmp_path):
    prepare_out_dir(tmp_path, settings(plain_of(["temperature=1.2"])))
    other = plain_of(["temperature=1.2"])[0]
    object.__setattr__(other, "filters", {"temperature": 1.3})
    with pytest.raises(ResumeMismatch, match="plain arm temperature=1.2 with other settings"):
        prepare_out_dir(tmp_path, settings([other]))


@pytest.mark.parametrize(
    "spec, message",
    [
        (["beta=0.4"], "unknown key 'beta'"),
        (["n=4"], "unknown key 'n'"),
        (["temperature=9"], "--plain temperature='9'"),
        (["temperature=abc"], "--plain temperature='abc'"),
        (["min_p=1"], "--plain min_p='1'"),
        (["temperature=1.2,1.2"], "lists 1.2 twice"),
        (["temperature"], "KEY=VALUE"),
    ],
)
def test_bad_plain_values_name_the_key(spec, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("'", "'")):
        plain_of(spec)


def test_repeating_another_arm_or_the_baseline_is_refused():
    with pytest.raises(ConfigError, match="temperature=1.2,top_p=0.95 samples exactly like temperature=1.2"):
        settings(plain_of(["temperature=1.2"], ["temperature=1.2", "top_p=0.95"]))
    with pytest.raises(ConfigError, match="exactly like the baseline") as info:
        settings(plain_of(["temperature=0.8,1.2"]))
    assert "already a point of the temperature curve" in info.value.hint


@needs_math_verify
def test_plain_arms_from_flags_and_the_matrix_file_run_beside_the_cells(tmp_path, engines, capsys):
    matrix = tmp_path / "m.toml"
    matrix.write_text(f"""
task_files = ["{task_file(tmp_path)}"]
n = 4
engine = "reference"
out = "{tmp_path / "run"}"
[matrix]
beta = [0.4, 1.2]
[[plain]]
temperature = [1.5]
top_p = 1.0
min_p = 0.1
""")
    assert main(["eval", "--matrix-file", str(matrix), "--plain", "temperature=0.4,1.2", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "baseline + 3 plain arms + 2 cells" in err
    assert "baseline 4 groups (once, shared by every cell), plain arms 12 groups, cells 8 groups" in err
    assert len(engines) == 1
    started = engines[0][0].started
    assert sorted({k.split("|")[1] for k in started}) == sorted(
        [
            "baseline",
            "temperature=1.5,top_p=1.0,min_p=0.1",
            "temperature=0.4",
            "temperature=1.2",
            "beta=0.4",
            "beta=1.2",
        ]
    )
    run = json.loads((tmp_path / "run" / "run.json").read_text())["settings"]
    assert list(run["plain"]) == ["temperature=1.5,top_p=1.0,min_p=0.1", "temperature=0.4", "temperature=1.2"]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert set(report["arms"]) == {"baseline", *run["plain"], "beta=0.4", "beta=1.2"}


@needs_math_verify
def test_one_matrix_file_serves_a_run_per_task(tmp_path, engines, capsys):
    """The command line picks one task; a [task.NAME] table for another of the file's tasks is no
    error, one for a task the file does not list is."""
    matrix = tmp_path / "m.toml"
    matrix.write_text('tasks = ["arith", "open"]\nn = 2\nno_diversity = true\n[task.open]\nmax_tokens = 16\n')
    argv = [
        "eval",
        "--matrix-file",
        str(matrix),
        "--task-file",
        str(task_file(tmp_path)),
        "--quiet",
        "--engine",
        "reference",
    ]
    assert main(argv + ["--out", str(tmp_path / "o")]) == 0
    matrix.write_text('tasks = ["arith"]\nn = 2\n[task.opn]\nmax_tokens = 16\n')
    assert main(argv + ["--out", str(tmp_path / "p")]) == 2
    assert "m.toml: [task.opn] names no task of this run" in capsys.readouterr().err


@needs_math_verify
def test_problem_order_and_report_only_report_the_problems_every_arm_finished(tmp_path, engines, capsys):
    out = tmp_path / "out"
    argv = [
        "eval",
        "--task-file",
        str(task_file(tmp_path)),
        "-n",
        "2",
        "--engine",
        "reference",
        "--quiet",
        "--plain",
        "temperature=0.4,1.2",
        "--out",
        str(out),
    ]
    assert main(argv + ["--report-only"]) == 0  # nothing sampled yet: a report of no problems
    assert "problems: 0 of 4 finished" in (out / "report.md").read_text()
    assert not engines
    engines.create.interrupt_at_step = 50  # 6 steps a group: inside the third problem's arms
    assert main(argv + ["--order", "problems"]) == 130
    started = [k.split("|")[0] for k in engines[0][0].started]
    assert started[:8] == ["tasks-0"] * 4 + ["tasks-1"] * 4  # every arm of a problem, then the next
    assert main(argv + ["--report-only"]) == 0
    assert len(engines) == 1  # no engine: nothing sampled
    report = json.loads((out / "report.json").read_text())
    assert report["problems"]["finished"] == 2 and report["problems"]["asked"] == 4
    assert "groups not sampled; the report covers the problems every arm finished" in capsys.readouterr().err
