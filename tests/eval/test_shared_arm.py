"""The shared Distiller as an eval arm: a matrix key (engine-wide), an engine per shared cell, and a
run that adds shared cells to the committed frontier folder beside its own, reusing its baseline."""

import gzip
import json
from pathlib import Path

import esamp.commands.eval as eval_cli
from esamp.commands.cli import main
from esamp.core.config import EsampConfig
from esamp.eval.matrix import MATRIX_KEYS, build_cells, engine_groups, parse_axes, validate_axes

ROOT = Path(__file__).resolve().parents[2]
FRONTIER = ROOT / "benchmarks" / "eval_frontier_cpu.toml"
COMMITTED = ROOT / "benchmarks" / "results" / "eval-cpu-frontier" / "arith"


def cells_of(*items):
    base = EsampConfig()
    return build_cells(validate_axes(parse_axes(list(items)), base), base)


def test_the_distiller_is_an_engine_wide_matrix_key_and_each_shared_cell_gets_its_own_engine():
    assert "distiller" in MATRIX_KEYS
    cells = cells_of("distiller=bank,shared", "mix=paper,unsharpened")
    assert [c.name for c in cells] == [
        "distiller=bank,mix=paper",
        "distiller=bank,mix=unsharpened",
        "distiller=shared,mix=paper",
        "distiller=shared,mix=unsharpened",
    ]
    assert [c.record()["distiller"] for c in cells] == ["bank", "bank", "shared", "shared"]
    # bank cells that differ in steering share an engine; a shared Distiller learns from every group
    # its engine steers, so each shared cell runs alone on its own
    groups = engine_groups(cells)
    assert [[c.name for c in members] for _, members in groups] == [
        ["distiller=bank,mix=paper", "distiller=bank,mix=unsharpened"],
        ["distiller=shared,mix=paper"],
        ["distiller=shared,mix=unsharpened"],
    ]
    assert [config.distiller for config, _ in groups] == ["bank", "shared", "shared"]


def test_shared_cells_join_the_committed_frontier_run_and_leave_its_arms_as_they_are(tmp_path, monkeypatch, capsys):
    """The command in eval_frontier_cpu.toml's header, on a copy of the committed arith folder as
    it was before its shared cells (they are taken out of the copy): two new cells, the baseline
    and the plain arms reused, the other cells' records unchanged."""
    out = tmp_path / "arith"
    out.mkdir()
    run = json.loads((COMMITTED / "run.json").read_text())
    run["settings"]["cells"] = {k: v for k, v in run["settings"]["cells"].items() if "distiller=shared" not in k}
    (out / "run.json").write_text(json.dumps(run))
    with gzip.open(COMMITTED / "samples.jsonl.gz", "rt") as src, open(out / "samples.jsonl", "w") as dst:
        dst.writelines(line for line in src if "distiller=shared" not in json.loads(line)["arm"])
    committed = run["settings"]
    sampled = {}

    def sample(args, runs, cells, todo, engine_name, total, started, out):
        sampled.update(
            cells=[c.name for c in cells],
            todo=todo[runs[0].name],
            engines=[[c.name for c in m] for _, m in engine_groups(cells)],
        )

    monkeypatch.setattr(eval_cli, "_sample", sample)
    monkeypatch.setattr(eval_cli, "_write_report", lambda *a: None)
    assert (
        main(
            [
                "eval",
                "--matrix-file",
                str(FRONTIER),
                "--task",
                "arith",
                "--limit",
                "20",
                "--matrix",
                "distiller=shared",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    new = ["beta=0.8,mix=paper,distiller=shared", "beta=0.8,mix=unsharpened,distiller=shared"]
    assert "new arms here: " + ", ".join(new) in capsys.readouterr().err
    assert sampled["engines"] == [[new[0]], [new[1]]]
    assert {arm: left for arm, left in sampled["todo"].items() if left} == dict.fromkeys(new, 20)  # the rest is done
    settings = json.loads((out / "run.json").read_text())["settings"]
    for name, record in committed["cells"].items():
        assert settings["cells"][name] == record
    assert settings["plain"] == committed["plain"]
    assert all(settings["cells"][name]["distiller"] == "shared" for name in new)
