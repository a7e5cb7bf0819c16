"""The settings matrix: cells from KEY=V,V, validated by the settings models; one baseline for all."""

import json

import pytest

from esamp.core.config import EsampConfig
from esamp.errors import ConfigError
from esamp.eval.matrix import (
    BASELINE,
    MATRIX_KEYS,
    Cell,
    build_cells,
    engine_groups,
    parse_axes,
    validate_axes,
)
from esamp.eval.report import summarize
from esamp.eval.runner import (
    EvalSettings,
    ResumeMismatch,
    prepare_out_dir,
    problem_seed,
    read_records,
    run_groups,
)
from esamp.eval.tasks import Problem

from .fake_engine import FakeEngine
from .test_runner import grade, measure

PROBLEMS = [Problem(id=f"p{i}", kind="math", prompt=f"question {i}", answer="2") for i in range(5)]


def cells_of(*items, base=None):
    base = base or EsampConfig()
    return build_cells(validate_axes(parse_axes(list(items)), base), base)


def settings(cells, **kw):
    return EvalSettings(
        task="fake", problem_ids=[p.id for p in PROBLEMS], n=4, ks=[1, 2, 4], engine="fake", cells=cells, **kw
    )


def test_cells_are_the_cross_product_named_by_their_values():
    cells = cells_of("beta=0.4,1.2", "mix=paper,unsharpened")
    assert [c.name for c in cells] == [
        "beta=0.4,mix=paper",
        "beta=0.4,mix=unsharpened",
        "beta=1.2,mix=paper",
        "beta=1.2,mix=unsharpened",
    ]
    assert cells[3].steering.beta == 1.2 and cells[3].steering.mix == "unsharpened"
    assert all(c.steering.train for c in cells)
    assert [c.name for c in build_cells({}, EsampConfig(beta=0.3))] == ["esamp"]


def test_every_per_group_and_engine_wide_key_is_a_matrix_key():
    for key in ("beta", "mix", "train", "train_rows", "optimizer", "lr"):
        assert key in MATRIX_KEYS
    cells = cells_of("train=on,off", "train_rows=all,group", "optimizer=sgd", "lr=1e-2")
    assert [(c.steering.train, c.steering.train_rows) for c in cells] == [
        (True, "all"),
        (True, "group"),
        (False, "all"),
        (False, "group"),
    ]
    assert {(c.config.optimizer, c.config.lr) for c in cells} == {("sgd", 0.01)}


@pytest.mark.parametrize(
    "items, message",
    [
        (["beta=12"], "--matrix beta='12'"),  # names the key and its range
        (["beta=abc"], "--matrix beta='abc'"),
        (["mix=sharp"], "--matrix mix='sharp'"),
        (["lr=0"], "--matrix lr='0'"),
        (["gamma=1"], "unknown key 'gamma'"),
        (["enabled=off"], "unknown key 'enabled'"),  # the baseline is the arm with ESamp off
        (["beta"], "is not KEY=VALUE"),
        (["beta=0.4,"], "empty value"),
        (["beta=0.4,0.40"], "lists 0.4 twice"),
        (["beta=0.4", "beta=0.8"], "names beta twice"),
    ],
)
def test_bad_matrix_values_name_the_key(items, message):
    with pytest.raises(ConfigError) as err:
        cells_of(*items)
    assert message in str(err.value) and err.value.hint


def test_a_bad_value_says_the_allowed_range():
    with pytest.raises(ConfigError, match=r"allowed: >= 0.0 and <= 10.0"):
        cells_of("beta=0.4,12")


def test_engine_wide_keys_split_the_cells_over_engines():
    groups = engine_groups(cells_of("beta=0.4,1.2", "lr=0.001,0.01"))
    assert [(cfg.lr, [c.name for c in members]) for cfg, members in groups] == [
        (0.001, ["beta=0.4,lr=0.001", "beta=1.2,lr=0.001"]),
        (0.01, ["beta=0.4,lr=0.01", "beta=1.2,lr=0.01"]),
    ]
    assert len(engine_groups(cells_of("beta=0.4,1.2", "mix=paper,unsharpened", "train_rows=all,group"))) == 1


def test_the_baseline_is_sampled_once_for_every_cell(tmp_path):
    cells = cells_of("beta=0.4,0.8,1.2")
    s = settings(cells)
    prepare_out_dir(tmp_path, s)
    engine = FakeEngine()
    records = run_groups(PROBLEMS, engine, s, tmp_path, grade, measure)
    arms = [key.split("|")[1] for key in engine.started]
    assert arms.count(BASELINE) == len(PROBLEMS)  # 3 cells cost 4 arms, not 6
    assert len(engine.started) == len(PROBLEMS) * 4
    assert set(records) == {(p.id, arm) for p in PROBLEMS for arm in s.arms}
    # every arm of a problem shares its seed; each cell carries its own steering
    for p in PROBLEMS:
        assert {records[(p.id, arm)]["seed"] for arm in s.arms} == {problem_seed(0, p.id)}
    steering = {key.split("|")[1]: cfg for key, cfg in zip(engine.started, engine.steerings)}
    assert not steering[BASELINE].enabled
    assert [steering[c.name].beta for c in cells] == [0.4, 0.8, 1.2]
    summary = summarize(PROBLEMS, records, s)
    assert set(summary["cells"]) == {c.name for c in cells} and "deltas" not in summary
    for cell in summary["cells"].values():
        assert cell["deltas"]["pass@1"]["baseline"] == summary["arms"][BASELINE]["pass@1"]


def test_a_new_cell_in_a_finished_folder_reuses_its_baseline(tmp_path):
    first = settings(cells_of("beta=0.4,0.8"))
    prepare_out_dir(tmp_path, first)
    before = run_groups(PROBLEMS, FakeEngine(), first, tmp_path, grade, measure)

    more = settings(cells_of("beta=0.4,0.8,1.2"))
    assert prepare_out_dir(tmp_path, more) == ["beta=1.2"]
    engine = FakeEngine()
    after = run_groups(PROBLEMS, engine, more, tmp_path, grade, measure)
    assert {key.split("|")[1] for key in engine.started} == {"beta=1.2"}  # nothing else resampled
    for key, record in before.items():
        assert after[key] == record
    recorded = json.loads((tmp_path / "run.json").read_text())["settings"]["cells"]
    assert set(recorded) == {"beta=0.4", "beta=0.8", "beta=1.2"}


def test_resume_runs_only_the_missing_groups_of_each_cell(tmp_path):
    s = settings(cells_of("beta=0.4,1.2", "mix=paper,unsharpened"))
    full = tmp_path / "full"
    prepare_out_dir(full, s)
    whole = run_groups(PROBLEMS, FakeEngine(), s, full, grade, measure)

    cut = tmp_path / "cut"
    prepare_out_dir(cut, s)
    with pytest.raises(KeyboardInterrupt):  # 6 steps a group: stops in the third arm
        run_groups(PROBLEMS, FakeEngine(interrupt_at_step=75), s, cut, grade, measure)
    partial = read_records(cut)
    done_arms = {arm for arm in s.arms if all((p.id, arm) in partial for p in PROBLEMS)}
    assert done_arms == {BASELINE, "beta=0.4,mix=paper"}  # arms run one after another

    engine = FakeEngine()
    resumed = run_groups(PROBLEMS, engine, s, cut, grade, measure)
    assert set(engine.started).isdisjoint(f"{p}|{a}" for p, a in partial)
    assert len(engine.started) == len(whole) - len(partial)
    assert {k: r["texts"] for k, r in resumed.items()} == {k: r["texts"] for k, r in whole.items()}


def test_changing_a_cells_settings_is_refused(tmp_path):
    base = EsampConfig()
    prepare_out_dir(tmp_path, settings([Cell("beta=0.4", base.with_steering(beta=0.4))]))
    other = base.with_steering(beta=0.4, mix="unsharpened")
    with pytest.raises(ResumeMismatch, match=r"cell beta=0.4 with other settings \(mix 'paper' there"):
        prepare_out_dir(tmp_path, settings([Cell("beta=0.4", other)]))
    with pytest.raises(ResumeMismatch, match="n differ"):
        prepare_out_dir(
            tmp_path,
            EvalSettings(
                task="fake",
                problem_ids=[p.id for p in PROBLEMS],
                n=8,
                engine="fake",
                cells=[Cell("beta=0.4", base.with_steering(beta=0.4))],
            ),
        )
    # -k changes no sample: a resumed run may report other k
    prepare_out_dir(
        tmp_path,
        EvalSettings(
            task="fake",
            problem_ids=[p.id for p in PROBLEMS],
            n=4,
            ks=[1],
            engine="fake",
            cells=[Cell("beta=0.4", base.with_steering(beta=0.4))],
        ),
    )


def test_a_folder_from_before_cells_resumes_as_the_cell_esamp(tmp_path):
    old = {
        "task": "fake",
        "problem_ids": [p.id for p in PROBLEMS],
        "n": 4,
        "ks": [1, 2, 4],
        "beta": 0.8,
        "mix": "paper",
        "seed": 0,
        "max_tokens": 256,
        "temperature": 0.8,
        "top_p": 0.95,
        "top_k": 0,
        "min_p": 0.1,
        "engine": "fake",
        "model": None,
    }
    (tmp_path / "run.json").write_text(json.dumps({"settings": old}))
    prepare_out_dir(tmp_path, EvalSettings(task="fake", problem_ids=[p.id for p in PROBLEMS], n=4, engine="fake"))
    (tmp_path / "run.json").write_text(json.dumps({"settings": old}))
    with pytest.raises(ResumeMismatch, match="beta"):
        prepare_out_dir(
            tmp_path, EvalSettings(task="fake", problem_ids=[p.id for p in PROBLEMS], n=4, engine="fake", beta=0.3)
        )
