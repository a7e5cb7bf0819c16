"""The scripts in ``benchmarks/``: each is in the table of benchmarks/README.md ("The scripts"),
each command the table gives parses with the script's own arguments, ``--help`` answers and an
unknown flag stops with exit status 2. Nothing is measured: the scripts run in one interpreter
whose ``ArgumentParser.parse_args`` stops each of them once its arguments are parsed. The eval
matrix files are read by ``esamp eval`` up to its first sample."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import esamp.commands.eval as eval_cli
from esamp.commands.cli import main

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.iterdir() if p.suffix == ".py")
MATRIX_FILES = sorted(p.name for p in BENCH.iterdir() if p.suffix == ".toml")
SHELL = sorted(p.name for p in BENCH.iterdir() if p.suffix == ".sh")
COMMAND = re.compile(r"^(?:PYTHONPATH=\S+ )?(?:\.venv/bin/)?python3? benchmarks/(\w+\.py)(?: (.*))?$")

# Runs each (script, argv) as ``python script argv...`` would, in this one process, and reports
# how it ended: "parsed" (its arguments were read, nothing else ran) or the exit status.
HARNESS = r"""
import argparse, contextlib, io, json, runpy, sys

class Parsed(Exception):
    pass

original = argparse.ArgumentParser.parse_args

def parse_args(self, args=None, namespace=None):
    original(self, args, namespace)
    raise Parsed

argparse.ArgumentParser.parse_args = parse_args
results = []
for path, argv in json.load(sys.stdin):
    sys.argv = [path, *argv]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
            end = "ran to its end"
        except Parsed:
            end = "parsed"
        except SystemExit as exc:
            end = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        except BaseException as exc:
            end = f"{type(exc).__name__}: {exc}"
    results.append({"end": end, "stdout": out.getvalue()[:2000], "stderr": err.getvalue()[-2000:]})
print(json.dumps(results))
"""


def scripts_section() -> str:
    text = (BENCH / "README.md").read_text(encoding="utf-8")
    start = text.index("\n## The scripts\n")
    return text[start : text.index("\n## ", start + 1)]


def table_commands() -> list[tuple[str, list[str]]]:
    """Every ``python benchmarks/NAME.py ...`` in the table, as (NAME.py, its arguments)."""
    found = []
    for span in re.findall(r"`([^`]+)`", scripts_section()):
        m = COMMAND.match(span)
        if m:
            found.append((m.group(1), shlex.split(m.group(2) or "")))
    return found


COMMANDS = table_commands()
FIRST = {name: argv for name, argv in reversed(COMMANDS)}  # each script's first command in the table
CASES = (
    [(name, argv) for name, argv in COMMANDS]
    + [(name, ["--help"]) for name in SCRIPTS]
    + [(name, [*FIRST.get(name, []), "--no-such-flag"]) for name in SCRIPTS]
)


@pytest.fixture(scope="module")
def ends() -> dict[tuple[str, str], dict]:
    cases = [(str(BENCH / name), argv) for name, argv in CASES]
    proc = subprocess.run(
        [sys.executable, "-c", HARNESS],
        input=json.dumps(cases),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    return {(name, shlex.join(argv)): r for (name, argv), r in zip(CASES, results)}


def test_every_script_here_is_in_the_table_and_the_table_names_none_that_is_gone():
    section = scripts_section()
    named = set(re.findall(r"`([\w.-]+\.(?:py|sh|toml))`", section))
    for name in SCRIPTS + SHELL + MATRIX_FILES:
        assert f"`{name}`" in section, f"benchmarks/README.md's table does not describe {name}"
    gone = {name for name in named if not (BENCH / name).exists()}
    assert not gone, f"benchmarks/README.md's table names scripts that are not in benchmarks/: {sorted(gone)}"
    # every Python script has a command there that the next test parses
    assert {name for name, _ in COMMANDS} == set(SCRIPTS)


@pytest.mark.parametrize("name, argv", COMMANDS, ids=[shlex.join([n, *a]) for n, a in COMMANDS])
def test_each_command_in_the_table_parses(ends, name, argv):
    end = ends[(name, shlex.join(argv))]
    assert end["end"] == "parsed", end


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_answers_and_an_unknown_flag_stops_with_status_2(ends, name):
    """--help, and the table's first command with a flag the script does not know."""
    helped, refused = ends[(name, "--help")], ends[(name, shlex.join([*FIRST.get(name, []), "--no-such-flag"]))]
    assert helped["end"] == 0 and helped["stdout"].startswith("usage: "), helped
    assert refused["end"] == 2 and "unrecognized arguments: --no-such-flag" in refused["stderr"], refused


def test_the_shell_scripts_say_their_usage(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    suite = subprocess.run(
        ["bash", "benchmarks/gpu_suite.sh", "no-such-mode"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert suite.returncode == 2 and "usage:" in suite.stdout, suite
    kit = subprocess.run(["bash", "benchmarks/kit_add.sh"], cwd=ROOT, capture_output=True, text=True)
    assert kit.returncode == 2 and "usage:" in kit.stderr, kit
    for script in ("gpu_kit.sh", "gpu_stage.sh"):  # an unknown option: the usage, nothing built or staged
        run = subprocess.run(
            ["bash", str(BENCH / script), "--no-such-option"], cwd=tmp_path, capture_output=True, text=True
        )
        assert run.returncode == 2 and "usage:" in run.stderr, (script, run)


@pytest.mark.parametrize("name", MATRIX_FILES)
def test_each_matrix_file_is_read_by_esamp_eval(name, tmp_path, monkeypatch, capsys):
    """What ``esamp eval --matrix-file FILE`` checks before it samples: its keys, tasks, cells and
    plain arms; the sampling and the report are left out."""
    seen = {}

    def sample(args, runs, cells, todo, engine_name, total, started, out):
        seen.update(cells=[c.name for c in cells], tasks=[r.name for r in runs])

    monkeypatch.setattr(eval_cli, "_sample", sample)
    monkeypatch.setattr(eval_cli, "_write_report", lambda *a: None)
    argv = ["eval", "--matrix-file", str(BENCH / name), "--limit", "1", "--out", str(tmp_path / "out")]
    assert main(argv) == 0, capsys.readouterr().err
    assert seen["cells"] and seen["tasks"], seen
