"""``scripts/setup.sh`` says what it is doing: a line per phase, before the phase, with its time.

Run against a stand-in Python that records what it is asked to do, so nothing is installed.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STUB = """#!/bin/sh
# a stand-in python: "-m venv DIR" makes DIR/bin/python (this script), anything else is logged
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0; fi
if [ "$1" = "-c" ]; then echo "esamp 0.1.0 torch 2.13.0+cpu"; exit 0; fi
echo "RAN $*"
"""


def run_setup(tmp_path: Path, *args: str) -> list[str]:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", repo / "scripts" / "setup.sh")
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    bin_dir = tmp_path / "bin"  # a bwrap on PATH, so --dev never reaches for apt-get
    bin_dir.mkdir()
    (bin_dir / "bwrap").write_text("#!/bin/sh\n")
    (bin_dir / "bwrap").chmod(0o755)
    env = dict(os.environ, PYTHON=str(stub), PATH=f"{bin_dir}:{os.environ['PATH']}")
    done = subprocess.run(
        ["bash", str(repo / "scripts" / "setup.sh"), *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("args, phases", [((), 4), (("--dev",), 8)], ids=["app", "dev"])
def test_every_phase_is_announced_before_it_runs(tmp_path, args, phases):
    lines = run_setup(tmp_path, *args)
    assert lines[0].startswith("Setting up esamp in .venv") and re.search(r"about \d+ (s|minutes?)$", lines[0])
    steps = [line for line in lines if re.match(r"\[\d+/\d+\] ", line)]
    assert [s.split("]")[0] + "]" for s in steps] == [f"[{k}/{phases}]" for k in range(1, phases + 1)]
    for step in steps:  # what it does and about how long
        assert re.search(r"\((about \d+ (s|minutes?)|a few seconds)[;)]", step), step
    announced, installs = False, 0
    for line in lines:  # each install comes after a phase line of its own
        if re.match(r"\[\d+/\d+\] ", line):
            announced = True
        elif line.startswith("RAN -m pip") and " install " in line:
            assert announced, f"{line!r} ran with no phase line before it"
            announced, installs = False, installs + 1
    assert installs == phases - (2 if args else 1)  # the venv (and bubblewrap) phases install nothing with pip
    assert re.match(r"esamp is set up in \.venv in \d+ s \(esamp .* torch .*\)$", lines[-1])


def test_torch_phase_says_where_torch_comes_from(tmp_path):
    torch = next(line for line in run_setup(tmp_path) if "torch 2.13.0" in line and line.startswith("["))
    assert "local wheel folder" in torch and "downloads" in torch
