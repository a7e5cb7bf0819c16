"""``esamp eval`` as a user runs it, on the scripted engine: the matrix, its report and plots, the
matrix file, resume and sessions, and every bad input answered with exit 2 and a hint."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import esamp.commands.eval as eval_cli
import esamp.engines
from esamp.commands.cli import main

from .fake_engine import FakeEngine
from .test_runner import measure

needs_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None, reason="needs math-verify (the eval extra)"
)
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (the eval extra)"
)
ROOT = Path(__file__).resolve().parents[2]


def task_file(tmp_path, name="tasks", count=4, kind="math"):
    path = tmp_path / f"{name}.jsonl"
    rows = [
        {"id": f"{name}-{i}", "prompt": f"What is {i} + 1?", **({"answer": "2"} if kind == "math" else {})}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Made(list):
    """The engines a command created, each with the keyword arguments it got."""


@pytest.fixture
def engines(monkeypatch):
    """Every engine the command creates, with the keyword arguments it got."""
    made = Made()

    def create(name, model=None, **kw):
        made.append((FakeEngine(esamp=kw.get("esamp"), interrupt_at_step=create.interrupt_at_step), kw))
        return made[-1][0]

    create.interrupt_at_step = None
    monkeypatch.setattr(esamp.engines, "create_engine", create)
    monkeypatch.setattr(eval_cli, "_diversity_measure", lambda off: (lambda texts: None) if off else measure)
    made.create = create
    return made


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("bad input must be refused before an engine loads")

    monkeypatch.setattr(esamp.engines, "create_engine", refuse)


@needs_math_verify
@needs_matplotlib
def test_matrix_end_to_end_with_plots_and_html(tmp_path, engines, capsys):
    out = tmp_path / "out"
    argv = [
        "eval",
        "--task-file",
        str(task_file(tmp_path)),
        "-n",
        "4",
        "--engine",
        "reference",
        "--matrix",
        "beta=0.4,1.2",
        "mix=paper,unsharpened",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    progress = [line for line in err.splitlines() if line.startswith("[")]
    assert len(progress) == 4 * 5
    assert sum(" baseline " in line for line in progress) == 4  # the baseline, once per problem
    assert "baseline 4 groups (once, shared by every cell), cells 16 groups" in err
    assert "b = baseline" in err and "1 = beta=0.4,mix=paper" in err  # terminal charts
    assert len(engines) == 1

    report = json.loads((out / "report.json").read_text())
    cells = ["beta=0.4,mix=paper", "beta=0.4,mix=unsharpened", "beta=1.2,mix=paper", "beta=1.2,mix=unsharpened"]
    assert list(report["cells"]) == cells
    for cell in cells:
        assert set(report["cells"][cell]["deltas"]) >= {"pass@1", "pass@4", "vendi", "distinct_2"}
    md = (out / "report.md").read_text()
    for cell in cells:
        assert f"| {cell} |" in md
    assert "correct samples (of 16)" in md and "Quality against diversity" in md
    for view in ("passk", "plane", "shifts", "learning"):
        png = out / f"tasks-{view}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert f"]({png.name})" in md
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4
    assert 'src="http' not in html and "<link" not in html  # one file, nothing fetched
    assert "<table>" in html and "beta=1.2,mix=unsharpened" in html


@needs_math_verify
def test_engine_wide_keys_start_an_engine_each_and_the_baseline_runs_once(tmp_path, engines, capsys):
    out = tmp_path / "out"
    assert (
        main(
            [
                "eval",
                "--task-file",
                str(task_file(tmp_path)),
                "-n",
                "2",
                "--engine",
                "reference",
                "--no-diversity",
                "--quiet",
                "--matrix",
                "lr=0.001,0.01",
                "beta=0.4,0.8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert len(engines) == 2
    first, second = engines[0][0], engines[1][0]
    assert first.esamp is None  # the first engine runs on the defaults (lr 0.001)
    assert second.esamp.lr == 0.01
    # cells are named in the order the keys were given
    assert sorted(k.split("|")[1] for k in first.started) == sorted(
        ["baseline"] * 4 + ["lr=0.001,beta=0.4"] * 4 + ["lr=0.001,beta=0.8"] * 4
    )
    assert {k.split("|")[1] for k in second.started} == {"lr=0.01,beta=0.4", "lr=0.01,beta=0.8"}
    assert all(s.enabled for s in second.steerings)  # (lr is the engine's: a group brings only its steering)
    assert "engine 2 of 2" in capsys.readouterr().err


@needs_math_verify
def test_parallel_never_exceeds_the_distiller_bank(tmp_path, engines, capsys):
    assert (
        main(
            [
                "eval",
                "--task-file",
                str(task_file(tmp_path, count=6)),
                "-n",
                "2",
                "--engine",
                "reference",
                "--no-diversity",
                "--quiet",
                "--parallel",
                "5",
                "--slots",
                "2",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 0
    )
    engine, options = engines[0]
    assert options["esamp"].slots == 2
    assert engine.most_at_once == 2
    assert "--parallel 5 is more than the 2 Distiller slots; running 2" in capsys.readouterr().err


@needs_math_verify
def test_matrix_file_with_tasks_overrides_and_flags_that_win(tmp_path, engines, capsys):
    math_file, open_file = task_file(tmp_path, "sums"), task_file(tmp_path, "chat", count=3, kind="open")
    matrix = tmp_path / "m.toml"
    matrix.write_text(f"""
task_files = ["{math_file}", "{open_file}"]
n = 4
max_tokens = 64
engine = "reference"
out = "{tmp_path / "run"}"
no_diversity = true

[task.chat]
max_tokens = 32
limit = 2

[matrix]
beta = [0.4, 1.2]
""")
    assert main(["eval", "--matrix-file", str(matrix), "-n", "2", "--quiet"]) == 0
    run = tmp_path / "run"
    sums = json.loads((run / "sums" / "run.json").read_text())["settings"]
    chat = json.loads((run / "chat" / "run.json").read_text())["settings"]
    assert (sums["n"], sums["max_tokens"], len(sums["problem_ids"])) == (2, 64, 4)  # -n beat the file
    assert (chat["max_tokens"], len(chat["problem_ids"])) == (32, 2)
    assert list(sums["cells"]) == ["beta=0.4", "beta=1.2"]
    report = json.loads((run / "report.json").read_text())
    assert set(report["tasks"]) == {"sums", "chat"}
    md = (run / "report.md").read_text()
    assert "## sums" in md and "## chat" in md


@needs_math_verify
def test_interrupted_session_counts_and_resume_samples_only_what_is_missing(tmp_path, engines, capsys):
    out = tmp_path / "out"
    argv = [
        "eval",
        "--task-file",
        str(task_file(tmp_path)),
        "-n",
        "2",
        "--engine",
        "reference",
        "--no-diversity",
        "--quiet",
        "--matrix",
        "beta=0.4,1.2",
        "--out",
        str(out),
    ]
    engines.create.interrupt_at_step = 40  # 6 steps a group: inside the second cell
    assert main(argv) == 130
    sessions = json.loads((out / "sessions.json").read_text())
    assert len(sessions) == 1 and sessions[0]["finished"] is False and sessions[0]["wall_seconds"] >= 0
    assert sessions[0]["environment"]["engine"] == "fake"
    done = len((out / "samples.jsonl").read_text().splitlines())
    assert 0 < done < 12

    engines.create.interrupt_at_step = None
    assert main(argv) == 0
    assert len(engines[-1][0].started) == 12 - done
    sessions = json.loads((out / "sessions.json").read_text())
    assert [s["finished"] for s in sessions] == [False, True]
    meta = json.loads((out / "report.json").read_text())["meta"]
    assert meta["sessions"] == 2
    assert meta["wall_seconds"] == pytest.approx(sum(s["wall_seconds"] for s in sessions), abs=0.11)
    assert "over 2 sessions" in (out / "report.md").read_text()


@needs_math_verify
def test_a_second_matrix_into_the_same_folder_reports_every_cell_against_one_baseline(tmp_path, engines, monkeypatch):
    out = tmp_path / "out"
    base = [
        "eval",
        "--task-file",
        str(task_file(tmp_path)),
        "-n",
        "2",
        "--engine",
        "reference",
        "--no-diversity",
        "--quiet",
        "--out",
        str(out),
    ]

    def esamp(*argv):
        monkeypatch.setattr(sys, "argv", ["esamp", *argv])  # the command a session records
        return main(list(argv))

    assert esamp(*base, "--matrix", "mix=paper,unsharpened") == 0
    # Adam at its learning rate, then SGD at its own: the second run samples its cells only.
    assert esamp(*base, "--matrix", "mix=paper,unsharpened", "optimizer=sgd", "lr=0.1") == 0
    assert not any("baseline" in key for key in engines[-1][0].started)
    report = json.loads((out / "report.json").read_text())
    assert list(report["cells"]) == [
        "mix=paper",
        "mix=unsharpened",
        "mix=paper,optimizer=sgd,lr=0.1",
        "mix=unsharpened,optimizer=sgd,lr=0.1",
    ]
    assert len(report["meta"]["commands"]) == 2
    text = (out / "report.md").read_text()
    assert "4 ESamp cells varying" in text and "--matrix mix=paper,unsharpened optimizer=sgd lr=0.1" in text


@needs_math_verify
def test_regrade_rewrites_every_task_folder_without_sampling(tmp_path, engines, monkeypatch, capsys):
    out = tmp_path / "out"
    argv = [
        "eval",
        "--task-file",
        str(task_file(tmp_path, "a")),
        "--task-file",
        str(task_file(tmp_path, "b")),
        "-n",
        "2",
        "--engine",
        "reference",
        "--no-diversity",
        "--quiet",
        "--matrix",
        "beta=0.4,1.2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    path = out / "b" / "samples.jsonl"
    good = path.read_text()
    tampered = [json.loads(line) for line in good.splitlines()]
    for rec in tampered:
        rec["correct"] = 0
        rec["verdicts"] = [{"correct": False, "extracted": None, "note": "tampered"}] * len(rec["texts"])
    path.write_text("".join(json.dumps(r) + "\n" for r in tampered))

    def no_engine(*a, **k):
        raise AssertionError("nothing to sample")

    monkeypatch.setattr(esamp.engines, "create_engine", no_engine)
    assert main(argv + ["--regrade"]) == 0
    err = capsys.readouterr().err
    assert f"regraded 12 groups in {out / 'a'}" in err and f"regraded 12 groups in {out / 'b'}" in err
    assert [json.loads(line)["verdicts"] for line in path.read_text().splitlines()] == [
        json.loads(line)["verdicts"] for line in good.splitlines()
    ]


def read_only_folder(tmp_path) -> Path:
    """A folder this process cannot write into: permission bits, or (as root, who ignores
    them) sysfs, which refuses new files to everyone."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").write_text("")
    except OSError:
        return folder
    (folder / "probe").unlink()
    sysfs = Path("/sys/kernel")
    if sysfs.is_dir():
        try:
            (sysfs / "esamp-probe").write_text("")
        except OSError:
            return sysfs
    pytest.skip("no folder here refuses writes")


BAD_LINES = (
    b'{"id": "a", "prompt": "What is 1 + 1?", "answer": "2"}\n'
    b'{"id": "b", "prompt": "What is 2 + 2?", "answer": "4"\n'
    b'{"id": "c", "prompt": "caf\xe9", "answer": "1"}\n'
    b'{"id": "d", "prompt": "a \\udcff b", "answer": "1"}\n'
    b'{"id": "a", "prompt": "again", "answer": "1"}\n'
)


def bad_inputs(tmp_path):
    """(arguments, what the message must say); every case exits 2 with a hint, before sampling."""
    good = str(task_file(tmp_path))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    utf8 = tmp_path / "latin1.jsonl"
    utf8.write_bytes(b'{"id": "x", "prompt": "caf\xe9 au lait?", "answer": "1"}\n')
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"id": "x", "prompt": "ok"}\n{"id": "y", "prompt": "bad \\udcff"}\n')
    several = tmp_path / "several.jsonl"
    several.write_bytes(BAD_LINES)
    toml = tmp_path / "bad.toml"
    toml.write_text("n = 4\nbeta = 12\n")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("betta = 1\n")
    broken = tmp_path / "broken.toml"
    broken.write_text("n = [\n")
    plain_toml = tmp_path / "plain.toml"
    plain_toml.write_text("[[plain]]\ntemperature = [1.2]\n[[plain]]\ntop_p = [2]\n")
    plain_list = tmp_path / "plain-list.toml"
    plain_list.write_text("plain = [1.2]\n")
    read_only = read_only_folder(tmp_path)
    run = ["--task-file", good]
    return [
        (run + ["--seed", "-1"], "--seed=-1"),  # the rule esamp generate uses
        (run + ["-n", "0"], "-n=0"),
        (run + ["-n", "65"], "-n=65"),
        (run + ["--max-tokens", "-1"], "--max-tokens=-1"),
        (run + ["--temperature", "9"], "--temperature=9.0"),
        (run + ["--beta", "12"], "--beta=12.0"),
        (run + ["--slots", "0"], "--slots=0"),
        (run + ["--matrix", "beta=0.4,12"], "--matrix beta='12'"),
        (run + ["--matrix", "gamma=1"], "unknown key 'gamma'"),
        (run + ["--matrix", "beta"], "KEY=VALUE"),
        (run + ["--plain", "beta=0.4"], "--plain: unknown key 'beta'"),
        (run + ["--plain", "temperature=6"], "--plain temperature='6'"),
        (run + ["--plain", "temperature=0.8"], "plain arm temperature=0.8 samples exactly like the baseline"),
        (run + ["--plain", "temperature=1.2", "--plain", "temperature=1.2"], "samples exactly like temperature=1.2"),
        (["--matrix-file", str(plain_toml), "--task-file", good], "plain.toml [plain] top_p=2:"),
        (["--matrix-file", str(plain_list), "--task-file", good], "plain must be a table"),
        (run + ["--parallel", "0"], "--parallel 0"),
        (run + ["--threads", "0"], "0 is not a thread count"),
        (run + ["--limit", "0"], "--limit 0"),
        (run + ["-n", "4", "-k", "1,8"], "k=8"),
        (run + ["--out", str(a_file)], "is a file"),
        (run + ["--out", str(read_only)], "cannot write into --out"),
        (run + ["--out", str(read_only / "sub" / "dir")], "--out"),
        (["--task-file", str(utf8)], "latin1.jsonl line 1, column 27: byte 0xe9 is not UTF-8"),
        (["--task-file", str(surrogate)], "surrogate.jsonl line 2: 'prompt' holds the escape \\udcff"),
        (["--task-file", str(several)], "several.jsonl has 4 bad lines"),
        (["--task-file", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["--task", "nope"], "unknown task"),
        ([], "say what to evaluate on"),
        (["--task", "arith", "--task", "arith"], "named twice"),
        (["--matrix-file", str(toml), "--task-file", good], "bad.toml: beta=12"),
        (["--matrix-file", str(unknown), "--task-file", good], "unknown key(s) betta"),
        (["--matrix-file", str(broken), "--task-file", good], "not valid TOML"),
        (["--matrix-file", str(tmp_path / "none.toml")], "does not exist"),
    ]


def test_every_bad_input_exits_2_with_a_hint_before_sampling(tmp_path, no_engine, capsys):
    for argv, message in bad_inputs(tmp_path):
        try:
            code = main(["eval", *argv])
        except SystemExit as exc:  # refused while parsing the flags
            code = exc.code
        assert code == 2, argv
        err = capsys.readouterr().err
        assert ("error:" in err.splitlines()[-2] or err.startswith("error:")) and "hint:" in err, (argv, err)
        assert message in err, (argv, message, err)
        assert not (tmp_path / "out").exists()


def test_several_bad_lines_are_reported_at_their_columns(tmp_path, no_engine, capsys):
    path = tmp_path / "several.jsonl"
    path.write_bytes(BAD_LINES)
    assert main(["eval", "--task-file", str(path)]) == 2
    err = capsys.readouterr().err
    line2 = '{"id": "b", "prompt": "What is 2 + 2?", "answer": "4"'
    assert f"line 2, column {len(line2) + 1}: not valid JSON" in err and "closing brace" in err
    column = BAD_LINES.split(b"\n")[2].index(b"\xe9") + 1
    assert f"line 3, column {column}: byte 0xe9 is not UTF-8 text" in err
    assert "line 4: 'prompt' holds the escape \\udcff" in err
    assert "line 5: id 'a' already used on line 1" in err


@pytest.mark.parametrize("case", ["utf8", "out-file"])
def test_no_traceback_from_the_console_command(tmp_path, case):
    """The real command line, in its own process: exit 2, a message and a hint, no traceback."""
    if case == "utf8":
        path = tmp_path / "bytes.jsonl"
        path.write_bytes(b'{"id": 1, "prompt": "\xff\xfe", "answer": "1"}\n')
        argv = ["--task-file", str(path)]
    else:
        target = tmp_path / "taken"
        target.write_text("")
        argv = ["--task", "arith", "--out", str(target)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "esamp", "eval", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "hint:" in proc.stderr
