import importlib.util
import json

import pytest

import esamp.engines
from esamp.commands.cli import main

from .fake_engine import FakeEngine

needs_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None, reason="needs math-verify (the eval extra)"
)


def _task_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [{"id": f"q{i}", "prompt": f"What is {i} + 1?", "answer": "2"} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@needs_math_verify
def test_eval_end_to_end_then_resume_without_loading_the_engine(tmp_path, monkeypatch, capsys):
    made, options = [], []

    def fake_create(name, model=None, **kw):
        options.append(kw)
        made.append(FakeEngine())
        return made[-1]

    monkeypatch.setattr(esamp.engines, "create_engine", fake_create)
    out = tmp_path / "out"
    argv = [
        "eval",
        "--task-file",
        str(_task_file(tmp_path)),
        "-n",
        "4",
        "-k",
        "1,4",
        "--no-diversity",
        "--engine",
        "reference",
        "--threads",
        "1",
        "--out",
        str(out),
        "--quiet",
    ]
    assert main(argv) == 0
    first = json.loads((out / "report.json").read_text())
    assert first["problems"]["graded"] == 4
    assert set(first["deltas"]) == {"pass@1", "pass@4"}
    assert first["meta"]["environment"]["engine"] == "fake"
    md = (out / "report.md").read_text()
    assert "| pass@4 |" in md and "Per problem" in md
    assert len(made) == 1 and made[0].closed
    assert options == [{"threads": 1}]

    def no_engine(*a, **k):
        raise AssertionError("nothing left to generate: the engine must not load")

    monkeypatch.setattr(esamp.engines, "create_engine", no_engine)
    assert main(argv) == 0
    again = json.loads((out / "report.json").read_text())
    assert again["deltas"] == first["deltas"] and again["per_problem"] == first["per_problem"]


def test_user_errors_exit_2_with_a_hint(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "x", "answer": "1"}\nnot json\n')
    assert main(["eval", "--task-file", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl line 2" in err and "hint:" in err
    assert main(["eval", "--task", "arith", "-n", "4", "-k", "1,8"]) == 2
    assert "k=8" in capsys.readouterr().err
    assert main(["eval"]) == 2
    assert main(["eval", "--task", "nope"]) == 2
    assert "unknown task" in capsys.readouterr().err
