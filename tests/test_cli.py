"""``esamp generate`` as a user runs it: human output, JSON lines, and bad input."""

import json
import subprocess
import sys

import pytest

from esamp.cli import main
from esamp.events import event_from_json


@pytest.mark.slow
def test_human_output_shows_samples_and_a_summary(capsys):
    assert main(["generate", "Name a colour.", "-n", "2", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "sample 1/2" in out and "sample 2/2" in out
    summary = out.strip().splitlines()[-1]
    assert "tok/s" in summary and "mean Distiller loss" in summary and "port hits" in summary


@pytest.mark.slow
def test_json_output_is_one_typed_event_per_line(capsys):
    assert main(["generate", "Name a colour.", "-n", "2", "--max-tokens", "6", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    events = [event_from_json(line) for line in lines]
    assert {e.type for e in events} <= {"token", "step", "done", "error"}
    tokens = [json.loads(line) for line in lines if json.loads(line)["type"] == "token"]
    assert tokens and all({"sample", "text", "novelty"} <= set(t) for t in tokens)
    assert sum(e.type == "done" for e in events) == 2


@pytest.mark.slow
def test_no_esamp_reports_off(capsys):
    assert main(["generate", "Name a colour.", "-n", "1", "--max-tokens", "4", "--no-esamp"]) == 0
    out = capsys.readouterr().out
    assert "ESamp off" in out and "mean Distiller loss n/a" in out


@pytest.mark.parametrize(
    "args, words",
    [
        (["--beta", "12"], ["beta=12.0", "<= 10"]),
        (["-n", "0"], ["n=0", ">= 1"]),
        (["--model", "/no/such/model"], ["not found", "looked in"]),
        (["--top-p", "0"], ["top_p"]),
    ],
)
def test_bad_input_is_a_clear_error_without_traceback(args, words, capsys):
    assert main(["generate", "hello", *args]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err
    for word in words:
        assert word in err


def test_empty_prompt_is_rejected(capsys):
    assert main(["generate", "  "]) == 2
    assert "prompt is empty" in capsys.readouterr().err


def test_not_a_gguf_file(tmp_path, capsys):
    bad = tmp_path / "weights.gguf"
    bad.write_text("hello")
    assert main(["generate", "hello", "--model", str(bad)]) == 2
    assert "not a GGUF file" in capsys.readouterr().err


def test_json_mode_reports_errors_as_events(capsys):
    assert main(["generate", "hello", "--model", "/no/such/model", "--json"]) == 2
    line = capsys.readouterr().out.strip().splitlines()[-1]
    event = event_from_json(line)
    assert event.type == "error" and "not found" in event.message


@pytest.mark.slow
def test_prompt_longer_than_context_exits_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "esamp.cli", "generate", "word " * 9000, "--max-tokens", "4"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "longer than the model's context" in proc.stderr and "Traceback" not in proc.stderr
