"""--threads and OpenMP's wait policy (esamp/platform/threads.py; measured in benchmarks/threads.py)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from esamp.errors import ConfigError
from esamp.platform import threads

ROOT = Path(__file__).resolve().parents[2]


def test_one_thread_unless_asked():
    assert threads.check_threads(None) == threads.DEFAULT_THREADS == 1
    assert threads.check_threads(threads.available_cores()) == threads.available_cores()


@pytest.mark.parametrize("bad", [0, -1, 4096, True, 1.5])
def test_unusable_thread_counts_are_refused(bad):
    with pytest.raises(ConfigError, match="--threads"):
        threads.check_threads(bad)


def test_apply_threads_sets_torch_and_returns_the_count():
    # In a fresh process: an in-process vLLM CPU engine (other tests) disables torch.set_num_threads.
    import subprocess
    import sys

    code = (
        "import torch; from esamp.platform.threads import apply_threads; "
        "assert apply_threads(None) == 1 and torch.get_num_threads() == 1"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_the_users_wait_policy_wins(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    threads.prefer_passive_wait()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    threads.prefer_passive_wait()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_esamp_sets_the_policy_before_torch_loads():
    """libgomp reads OMP_WAIT_POLICY once, when torch loads it: the command must set it first."""
    code = (
        "import os, sys\n"
        "from esamp.commands.cli import main\n"
        "assert main(['generate', ' ']) == 2\n"  # refused before any engine loads
        "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["PASSIVE", "False"], out.stderr


def _threads_action(parser: argparse.ArgumentParser) -> argparse.Action:
    (action,) = [a for a in parser._actions if "--threads" in a.option_strings]
    return action


def _esamp_subparser(name: str) -> argparse.ArgumentParser:
    from esamp.commands.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices[name]


@pytest.mark.parametrize("command", ["esamp generate", "esamp eval", "esamp-tui"])
def test_every_command_that_runs_the_reference_engine_has_the_same_threads_flag(command):
    if command == "esamp-tui":
        from esamp_tui.__main__ import build_parser

        parser = build_parser()
    else:
        parser = _esamp_subparser(command.split()[1])
    reference = argparse.ArgumentParser()
    threads.add_threads_flag(reference)
    mine, theirs = _threads_action(parser), _threads_action(reference)
    assert (mine.type, mine.default, mine.help) == (theirs.type, theirs.default, theirs.help)


def test_threads_reach_only_the_reference_engine():
    assert threads.threads_option("reference", 2) == {"threads": 2}
    assert threads.threads_option("vllm", 2) == {}
    assert threads.threads_option("reference", None) == {}
