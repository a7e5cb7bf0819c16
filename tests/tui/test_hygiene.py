"""``esamp`` imports without textual; the dashboard's command line fails cleanly on bad flags."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = (
    "import sys\n"
    "import esamp, esamp.core.config, esamp.events, esamp.errors, esamp.platform.gpu, esamp.engines\n"
    "import esamp.engines.models, esamp.core.novelty\n"
    "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('textual', 'textual_plotext', 'esamp_tui'))\n"
    "assert not bad, bad\n"
)


def test_esamp_imports_without_textual():
    result = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_esamp_works_when_textual_is_not_installed(tmp_path):
    # A ``textual`` that fails to import stands in for an environment without it.
    (tmp_path / "textual").mkdir()
    (tmp_path / "textual" / "__init__.py").write_text("raise ImportError('textual is not installed')\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    result = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "args, needle",
    [
        (["-n", "9"], "1 to 8 samples"),
        (["-n", "0"], "-n=0"),
        (["--beta", "-1"], "--beta=-1.0"),
        (["--max-tokens", "0"], "--max-tokens=0"),
        (["--seed", "-1"], "--seed=-1"),
        (["--top-p", "0"], "--top-p=0.0"),
        (["--mix", "sharp"], "invalid choice: 'sharp'"),
        (["--theme", "nope"], "unknown theme 'nope'"),
        (["--prompt", "  "], "--prompt: the prompt is empty"),
        (["--prompt", "\u200b\x01"], "--prompt: the prompt is empty"),
        (["--prompt", b"Name a colour \xff now."], "not valid UTF-8"),
        (["--engine", "tpu"], "invalid choice"),
        (["-n", "four"], "invalid int value"),
        (["--threads", "0"], "argument --threads: 0 is not a thread count"),
        (["--distiller", "solo"], "invalid choice: 'solo'"),
        (["--server", "http://127.0.0.1:9", "--distiller", "shared"], "the server chose its Distiller"),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_bad_flags_exit_2_with_a_message(args, needle):
    result = subprocess.run(
        [sys.executable, "-m", "esamp_tui", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert needle in result.stderr
    assert "hint:" in result.stderr or "usage:" in result.stderr  # ours say what to do; argparse shows usage
    assert "Traceback" not in result.stderr


def test_a_rejected_theme_file_says_why(tmp_path):
    (tmp_path / "broken.toml").write_text('name = "broken"\n[colors]\nprimary = "not-a-colour"\n')
    env = dict(os.environ, ESAMP_THEME_DIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "esamp_tui", "--theme", "broken"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "theme 'broken' cannot be used" in result.stderr and "broken.toml was rejected" in result.stderr
    assert "'not-a-colour' is not a colour" in result.stderr
    assert "dark, high-contrast, light" in result.stderr  # the one list, as t cycles it


def test_help_lists_the_flags():
    result = subprocess.run(
        [sys.executable, "-m", "esamp_tui", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    for flag in (
        "--model",
        "--engine",
        "-n",
        "--beta",
        "--mix",
        "--no-esamp",
        "--seed",
        "--prompt",
        "--theme",
        "--max-tokens",
        "--threads",
        "--temperature",
        "--distiller",
    ):
        assert flag in result.stdout


def test_dashboard_process_does_not_import_the_engine_stack():
    """torch and transformers load only in the worker; the UI process starts fast and small."""
    code = (
        "import sys, esamp_tui.__main__ as m; m.build_parser(); import esamp_tui.app\n"
        "heavy = sorted(x for x in ('torch', 'transformers', 'vllm') if x in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
