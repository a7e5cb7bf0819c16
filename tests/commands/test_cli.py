"""``esamp generate`` as a user runs it: human output, JSON lines, and bad input."""

import json
import os
import subprocess
import sys

import pytest

from esamp.commands.cli import main
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
    lines = capsys.readouterr().out.strip().split("\n")  # JSON lines end at "\n" only (U+2028 stays raw)
    events = [event_from_json(line) for line in lines]
    assert {e.type for e in events} <= {"token", "step", "done", "error"}
    tokens = [json.loads(line) for line in lines if json.loads(line)["type"] == "token"]
    assert tokens and all({"sample", "text", "novelty"} <= set(t) for t in tokens)
    assert sum(e.type == "done" for e in events) == 2


def test_each_json_event_is_one_write_with_its_newline():
    """A reader of an unbuffered stdout never sees an event without its line end (print() would write
    the newline apart), and a line separator inside a token stays inside its line."""
    import io

    from esamp.commands.generate import _json_line
    from esamp.events import TokenEvent

    class Writes(io.StringIO):
        def __init__(self):
            super().__init__()
            self.writes = []

        def write(self, text):
            self.writes.append(text)
            return super().write(text)

    out = Writes()
    _json_line(out, TokenEvent(group="g", sample=0, index=0, token_id=5, text="a\u2028b\n", novelty=0.5))
    (written,) = out.writes
    assert written.endswith("}\n") and written.count("\n") == 1
    assert event_from_json(written).text == "a\u2028b\n"


@pytest.mark.slow
def test_no_esamp_reports_off(capsys):
    assert main(["generate", "Name a colour.", "-n", "1", "--max-tokens", "4", "--no-esamp"]) == 0
    out = capsys.readouterr().out
    assert "ESamp off" in out and "mean Distiller loss n/a" in out


@pytest.mark.parametrize(
    "args, words",
    [
        (["--beta", "12"], ["--beta=12.0", "<= 10"]),
        (["-n", "0"], ["-n=0", ">= 1"]),
        (["--model", "/no/such/model"], ["not found", "looked in"]),
        (["--top-p", "0"], ["--top-p=0.0"]),
        (["--max-tokens", "-1"], ["--max-tokens=-1", ">= 1"]),
        (["--seed", "-1"], ["--seed=-1", ">= 0"]),
        (["--slots", "0"], ["--slots=0", ">= 1"]),
        (["--threads", "0"], ["argument --threads: 0 is not a thread count"]),
    ],
)
def test_bad_input_is_a_clear_error_without_traceback(args, words, capsys):
    try:
        code = main(["generate", "hello", *args])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
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


@pytest.mark.parametrize(
    "args, words",
    [
        (["--model", "/no/such/model"], "not found"),
        (["--max-tokens", "0"], "--max-tokens=0"),
    ],
)
def test_json_mode_reports_errors_as_events(args, words, capsys):
    assert main(["generate", "hello", *args, "--json"]) == 2
    line = capsys.readouterr().out.strip().splitlines()[-1]
    event = event_from_json(line)
    assert event.type == "error" and words in event.message and event.hint


def test_json_mode_reports_an_incomplete_model_directory_as_an_event(tmp_path, capsys):
    """A directory with only config.json: no misleading "install sentencepiece", and an event."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert main(["generate", "hello", "--model", str(tmp_path), "--json"]) == 2
    captured = capsys.readouterr()
    event = event_from_json(captured.out.strip().splitlines()[-1])
    assert event.type == "error" and "no weights" in event.message and "tokenizer" in event.message
    assert "sentencepiece" not in captured.out + captured.err


@pytest.mark.parametrize(
    "prompt, words",
    [
        ("Name a colour \udcff now.", "not valid UTF-8"),
        ("\x00\x00", "prompt is empty"),
        ("\u200b\u200c\u200d\u2060\ufeff", "prompt is empty"),
    ],
)
def test_prompts_that_are_not_text_are_refused_before_loading(prompt, words, capsys, monkeypatch):
    import esamp.engines

    monkeypatch.setattr(esamp.engines, "create_engine", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["generate", prompt]) == 2
    assert words in capsys.readouterr().err


def test_generate_flags_come_from_the_settings_models():
    """Every sampling and steering flag is built from its field: help shows the field's range and
    default, and nothing about them is written in the command itself."""
    from esamp.commands.cli import build_parser
    from esamp.core.config import EsampConfig, SamplingConfig, flag_of

    sub = build_parser()._subparsers._group_actions[0].choices["generate"]
    flags = {s for a in sub._actions for s in a.option_strings}
    for model, fields in (
        (SamplingConfig, ("n", "max_tokens", "seed", "temperature", "top_p", "top_k", "min_p")),
        (EsampConfig, ("beta", "mix", "enabled", "slots", "distiller")),
    ):
        for field in fields:
            assert flag_of(model, field) in flags
    assert "--threads" in flags
    help_text = sub.format_help()
    assert "default 128" in help_text and "<= 64" in help_text  # --max-tokens, -n from the models


@pytest.mark.slow
def test_distiller_reaches_the_engine(monkeypatch, capsys):
    """--distiller shared: the engine esamp generate starts has one shared Distiller."""
    import esamp.engines

    real, seen = esamp.engines.create_engine, {}

    def create(*args, **kwargs):
        engine = real(*args, **kwargs)
        seen.update(distiller=engine.esamp.distiller, shared=engine.bank.shared)
        return engine

    monkeypatch.setattr(esamp.engines, "create_engine", create)
    assert (
        main(
            [
                "generate",
                "Name a colour.",
                "-n",
                "2",
                "--max-tokens",
                "2",
                "--engine",
                "reference",
                "--distiller",
                "shared",
                "--json",
            ]
        )
        == 0
    )
    assert seen == {"distiller": "shared", "shared": True}


def test_distiller_with_a_server_is_refused_not_ignored(capsys):
    """A served engine's Distiller is the server's: --distiller with --server says so, before connecting."""
    assert main(["generate", "hello", "--server", "http://127.0.0.1:9", "--distiller", "shared"]) == 2
    err = capsys.readouterr().err
    assert "--distiller shared with --server" in err and "esamp serve --distiller shared" in err


@pytest.mark.slow
def test_prompt_longer_than_context_exits_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "esamp", "generate", "word " * 9000, "--max-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "longer than the model's context" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_damaged_weights_are_a_message_not_a_traceback(tmp_path, capsys):
    """Config and tokenizer present, weights unreadable: the loader's reason, exit 2."""
    from esamp.engines import models

    source = models.resolve(None).hf_dir()
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (tmp_path / item.name).symlink_to(item)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    assert main(["generate", "hello", "--model", str(tmp_path), "--json"]) == 2
    captured = capsys.readouterr()
    event = event_from_json(captured.out.strip().splitlines()[-1])
    assert event.type == "error" and "could not load" in event.message and "weights" in event.hint
    assert "Traceback" not in captured.err


@pytest.mark.parametrize(
    "cuda, vllm, picked, why",
    [
        (True, "0.20.0", "vllm", "auto: CUDA GPU and vLLM 0.20.0"),
        (False, "0.30.0", "reference", "auto: no CUDA GPU (vLLM 0.30.0 is installed)"),
        (True, None, "reference", "auto: vLLM is not installed"),
    ],
)
def test_auto_picks_what_the_machine_does_best_and_says_why(monkeypatch, cuda, vllm, picked, why):
    import esamp.engines

    monkeypatch.setattr(esamp.engines, "gpu_visible", lambda: cuda)
    monkeypatch.setattr(esamp.engines, "vllm_version", lambda: vllm)
    choice = esamp.engines.choose_engine()
    assert (choice.name, choice.reason) == (picked, why)
    assert esamp.engines.choose_engine("reference").label == "reference"  # named: no reason to give


def test_auto_asks_nvml_not_torch(monkeypatch):
    """The dashboard decides its engine before any model loads: without importing torch."""
    import subprocess
    import sys

    code = "import sys; from esamp.engines import choose_engine; choose_engine(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_every_command_that_starts_an_engine_defaults_to_auto():
    """--engine, --model and --server are defined once; the dashboard, generate and eval share them,
    and serve and bench share --model (with a default of their own for bench)."""
    from esamp.commands.cli import build_parser
    from esamp.engines import DEFAULT_ENGINE
    from esamp_tui.__main__ import build_parser as tui_parser

    assert DEFAULT_ENGINE == "auto"
    subs = build_parser()._subparsers._group_actions[0].choices
    assert subs["generate"].parse_args(["hi"]).engine == "auto"
    assert subs["eval"].parse_args([]).engine is None  # a matrix file may name it; else DEFAULT_ENGINE
    assert tui_parser().parse_args([]).engine == "auto"
    for parser in (subs["generate"], subs["eval"], tui_parser()):
        help_text = " ".join(parser.format_help().split())
        assert "auto (default): the vLLM engine where a CUDA GPU and vLLM are present" in help_text
        assert "Qwen/Qwen2.5-7B-Instruct" in help_text
    for name, default in (
        ("serve", "default: the embedded SmolLM2-135M-Instruct"),
        ("bench", "default: qwen2.5-7b:dummy (random weights) on a GPU"),
    ):
        help_text = " ".join(subs[name].format_help().split())  # --model alone: what it takes, written once
        assert "Qwen/Qwen2.5-7B-Instruct" in help_text and default in help_text


def test_esamp_tui_on_a_gpu_machine_picks_vllm_and_passes_the_hub_id_on(monkeypatch):
    """``esamp-tui --model Qwen2.5-7B`` where a GPU and vLLM are present: the vLLM engine, the
    reason for the status bar, and the model name as typed (the worker resolves and downloads it)."""
    import esamp.engines
    import esamp_tui.__main__ as tui

    monkeypatch.setattr(esamp.engines, "gpu_visible", lambda: True)
    monkeypatch.setattr(esamp.engines, "vllm_version", lambda: "0.20.0")
    seen = {}
    monkeypatch.setattr(tui, "run_app", lambda options: seen.setdefault("options", options) and 0)
    assert tui.main(["--model", "Qwen2.5-7B"]) == 0
    options = seen["options"]
    assert (options.engine, options.engine_reason) == ("vllm", "auto: CUDA GPU and vLLM 0.20.0")
    spec = options.session_spec(options.esamp.steering, options.sampling)
    assert spec.engine == "vllm" and spec.model == "Qwen2.5-7B" and "threads" not in spec.engine_options


def test_vllms_log_and_flashinfers_go_to_stderr_warnings_only_unless_the_environment_says(monkeypatch):
    """Before a command loads vLLM: its log to stderr at WARNING, and FlashInfer's JIT (which logs
    the kernels it loads at INFO on a GPU) at WARNING too; a value the user set is kept."""
    from esamp.commands.cli import quiet_vllm_log

    for name in ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL", "FLASHINFER_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    quiet_vllm_log()
    assert os.environ["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"  # the user's
    assert os.environ["FLASHINFER_LOGGING_LEVEL"] == "WARNING"
