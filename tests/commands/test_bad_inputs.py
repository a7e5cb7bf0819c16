"""Every command on bad input: exit status 2, a message with a hint, never a traceback.

One table for ``esamp generate``, ``esamp eval``, ``esamp bench`` and ``esamp-tui`` (checked at
argument parsing; what it does with a bad prompt once running is tested with the dashboard). A new
command or flag joins by adding rows. ``needle`` is a piece of the message the user must see,
usually the flag as they typed it.

The ``esamp`` rows run in this process with model loading replaced by a tripwire, so a bad input
that slips through fails at once instead of loading a model; rows marked slow need the real
tokenizer. ``esamp bench`` sees a machine with 12 GiB of free RAM and no GPU, whatever runs it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from esamp.commands.cli import main
from esamp.engines import models

ROOT = Path(__file__).resolve().parents[2]
GIB = 1024**3
BAD_UTF8 = "Name a colour \udcff now."  # what Python makes of the byte 0xff in argv
GEN = ["esamp", "generate"]
EVAL = ["esamp", "eval", "--task", "arith", "--limit", "1", "-n", "2", "--no-diversity", "--quiet"]
BENCH = ["esamp", "bench"]
TUI = ["esamp-tui"]
slow = pytest.mark.slow

CASES = [
    # -- docs/generate.md's list (esamp generate) -----------------------------------------------
    ("unknown model path", GEN + ["hi", "--model", "/no/such/model"], "not found"),
    ("not a GGUF file", GEN + ["hi", "--model", "{not_gguf}"], "not a GGUF file"),
    ("setting out of range", GEN + ["hi", "--beta", "12"], "--beta=12.0"),
    ("empty prompt", GEN + ["  "], "prompt is empty"),
    pytest.param(
        "prompt longer than the context",
        GEN + ["word " * 9000, "--max-tokens", "4"],
        "longer than the model's context",
        marks=slow,
    ),
    # -- flags named as typed (issue: messages that name what the user typed) -----------------
    ("generate --max-tokens -1", GEN + ["hi", "--max-tokens", "-1"], "--max-tokens=-1"),
    ("generate -n 0", GEN + ["hi", "-n", "0"], "-n=0"),
    ("generate -n 65", GEN + ["hi", "-n", "65"], "-n=65"),
    ("generate --top-p 0", GEN + ["hi", "--top-p", "0"], "--top-p=0.0"),
    ("generate --temperature -1", GEN + ["hi", "--temperature", "-1"], "--temperature=-1.0"),
    ("generate --mix", GEN + ["hi", "--mix", "loud"], "invalid choice: 'loud'"),
    ("generate -n four", GEN + ["hi", "-n", "four"], "invalid int value: 'four'"),
    ("generate --engine", GEN + ["hi", "--engine", "tpu"], "invalid choice: 'tpu'"),
    (
        "generate --stop ''",
        GEN + ["hi", "--stop", "x", "--stop", ""],
        "--stop='': value error, a stop string cannot be empty",
    ),
    ("generate --stop without text", GEN + ["hi", "--stop"], "expected one argument"),
    ("eval -n 0", EVAL + ["-n", "0", "--out", "{tmp}/e-n0"], "-n"),
    ("eval no task", ["esamp", "eval"], "--task"),
    ("eval unknown task", ["esamp", "eval", "--task", "nope"], "nope"),
    ("eval a task as an argument", ["esamp", "eval", "arith"], "esamp eval --help"),
    ("generate unknown flag", GEN + ["hi", "--betta", "1"], "esamp generate --help"),
    ("eval missing task file", ["esamp", "eval", "--task-file", "{tmp}/missing.jsonl"], "missing.jsonl"),
    ("tui -n 9", TUI + ["-n", "9"], "1 to 8 samples"),
    ("tui --beta -1", TUI + ["--beta", "-1"], "--beta=-1.0"),
    ("tui --max-tokens 0", TUI + ["--max-tokens", "0"], "--max-tokens=0"),
    ("tui --engine", TUI + ["--engine", "tpu"], "invalid choice: 'tpu'"),
    ("tui --theme", TUI + ["--theme", "nope"], "nope"),
    # -- one rule for --seed -1 ---------------------------------------------------------------
    ("generate --seed -1", GEN + ["hi", "--seed", "-1"], "--seed=-1"),
    ("eval --seed -1", EVAL + ["--seed", "-1", "--out", "{tmp}/e-seed"], "--seed=-1"),
    ("bench --seed -1", BENCH + ["--seed", "-1"], "--seed=-1"),
    ("tui --seed -1", TUI + ["--seed", "-1"], "--seed=-1"),
    # -- --threads, the same flag on every command that runs the reference engine -------------
    ("generate --threads 0", GEN + ["hi", "--threads", "0"], "argument --threads: 0 is not a thread count"),
    ("generate --threads too many", GEN + ["hi", "--threads", "4096"], "argument --threads: 4096 is more than"),
    (
        "eval --threads 0",
        EVAL + ["--threads", "0", "--out", "{tmp}/e-t0"],
        "argument --threads: 0 is not a thread count",
    ),
    (
        "eval --threads too many",
        EVAL + ["--threads", "4096", "--out", "{tmp}/e-t"],
        "argument --threads: 4096 is more than",
    ),
    ("tui --threads 0", TUI + ["--threads", "0"], "argument --threads: 0 is not a thread count"),
    ("tui --threads too many", TUI + ["--threads", "4096"], "argument --threads: 4096 is more than"),
    # -- --slots, on every command that starts an engine --------------------------------------
    ("generate --slots 0", GEN + ["hi", "--slots", "0"], "--slots=0"),
    ("eval --slots 0", EVAL + ["--slots", "0", "--out", "{tmp}/e-s0"], "--slots=0"),
    ("bench --slots 0", BENCH + ["--slots", "0"], "--slots=0"),
    (
        "bench --slots below the workload",
        BENCH + ["--slots", "8", "--model", "qwen2.5-0.5b:dummy", "--workloads", "16x64"],
        "--slots=8",
    ),
    ("tui --slots 0", TUI + ["--slots", "0"], "--slots=0"),
    # -- --distiller (bank | shared), where it is a flag ----------------------------------------
    ("bench --distiller", BENCH + ["--distiller", "one"], "argument --distiller: invalid choice: 'one'"),
    ("eval --distiller", EVAL + ["--distiller", "one", "--out", "{tmp}/e-d"], "argument --distiller: invalid choice"),
    (
        "eval --matrix distiller",
        EVAL + ["--matrix", "distiller=bank,both", "--out", "{tmp}/e-md"],
        "--matrix distiller='both'",
    ),
    # -- prompts that are not text, or empty to the model -------------------------------------
    ("generate invalid UTF-8 prompt", GEN + [BAD_UTF8], "not valid UTF-8"),
    ("generate NUL prompt", GEN + ["\x00\x00"], "prompt is empty"),
    ("generate zero-width prompt", GEN + ["\u200b\u200d\ufeff"], "prompt is empty"),
    ("tui invalid UTF-8 prompt", TUI + ["--prompt", BAD_UTF8], "not valid UTF-8"),
    ("tui zero-width prompt", TUI + ["--prompt", "\u200b\u200d"], "empty"),
    # -- models that cannot load --------------------------------------------------------------
    ("model dir with only config.json", GEN + ["hi", "--model", "{config_only}"], "no weights"),
    ("model dir without weights", GEN + ["hi", "--model", "{no_weights}"], "no weights"),
    ("truncated GGUF", GEN + ["hi", "--model", "{truncated_gguf}"], "damaged or incomplete"),
    (
        "eval model dir with only config.json",
        EVAL + ["--model", "{config_only}", "--engine", "reference", "--out", "{tmp}/e-model"],
        "no weights",
    ),
    # -- eval's files -------------------------------------------------------------------------
    ("eval --out is a file", EVAL + ["--out", "{out_file}"], "out-file"),
    ("eval --out read-only", EVAL + ["--out", "{read_only}"], "esamp-out"),
    (
        "eval task file invalid UTF-8",
        ["esamp", "eval", "--task-file", "{task_bad_utf8}", "--out", "{tmp}/e-u"],
        "line 2",
    ),
    (
        "eval task file \\udcff escape",
        ["esamp", "eval", "--task-file", "{task_surrogate}", "--out", "{tmp}/e-s"],
        "line 1",
    ),
    (
        "eval task file, every bad line",
        ["esamp", "eval", "--task-file", "{task_many_bad}", "--out", "{tmp}/e-m"],
        "line 4",
    ),
    # -- bench ---------------------------------------------------------------------------------
    ("bench 7B on 12 GiB of RAM", BENCH + ["--model", "qwen2.5-7b:dummy"], "qwen2.5-0.5b:dummy"),
    ("bench --floor on 12 GiB of RAM", BENCH + ["--model", "qwen2.5-0.5b:dummy", "--floor"], "third engine"),
    ("bench --trials 0", BENCH + ["--trials", "0"], "--trials"),
    ("bench --min-trial-seconds -1", BENCH + ["--min-trial-seconds", "-1"], "--min-trial-seconds=-1"),
    ("bench --spread 1.5", BENCH + ["--spread", "1.5"], "--spread=1.5"),
    ("bench bad workload", BENCH + ["--workloads", "16y64"], "16y64"),
    ("bench --gpu-memory-utilization", BENCH + ["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    ("bench --top-p", BENCH + ["--top-p", "2"], "--top-p=2.0"),
]


class ReachedModelLoading(BaseException):
    """Raised where a model would start loading: the bad input was not refused before it.
    A BaseException, so no ``except Exception`` on the way turns it into a tidy message."""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The bad inputs' files, and a model cache of their own (``link_embedded_model`` puts the
    run's conversion of the embedded model there for the rows that need it; removed with the folder
    when the module is done)."""
    tmp = tmp_path_factory.mktemp("bad-inputs")
    yield _write_files(tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def _write_files(tmp: Path) -> dict[str, str]:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
    }
    (tmp / "config_only").mkdir()
    (tmp / "config_only" / "config.json").write_text(json.dumps(config))
    (tmp / "no_weights").mkdir()
    (tmp / "no_weights" / "config.json").write_text(json.dumps(config))
    (tmp / "no_weights" / "tokenizer.json").write_text("{}")
    (tmp / "not_gguf.gguf").write_text("hello")
    embedded = models.embedded_gguf()
    if embedded is not None:  # the real file's header, then the tensors cut short
        with open(embedded, "rb") as src:
            (tmp / "truncated.gguf").write_bytes(src.read(4_000_000))
    (tmp / "out-file").write_text("I am a file")
    if os.geteuid() == 0:  # root writes anywhere a mode bit forbids; sysfs refuses even root
        read_only = "/sys/esamp-out"
    else:
        (tmp / "ro").mkdir(mode=0o555)
        read_only = str(tmp / "ro" / "esamp-out")
    ok = json.dumps({"id": "a", "prompt": "What is 1 + 1?", "answer": "2"})
    (tmp / "bad_utf8.jsonl").write_bytes(ok.encode() + b"\n" + b'{"id": "b", "prompt": "caf\xff", "answer": "1"}\n')
    (tmp / "surrogate.jsonl").write_text('{"id": "a", "prompt": "x \\udcff y", "answer": "1"}\n')
    (tmp / "many_bad.jsonl").write_text(
        ok + '\n{"id": "b", "prompt": "p"\n' + ok.replace('"a"', '"c"') + '\n{"id": "d" "prompt": "q"}\n'
    )
    return dict(
        tmp=str(tmp),
        config_only=str(tmp / "config_only"),
        no_weights=str(tmp / "no_weights"),
        not_gguf=str(tmp / "not_gguf.gguf"),
        truncated_gguf=str(tmp / "truncated.gguf"),
        out_file=str(tmp / "out-file"),
        read_only=read_only,
        task_bad_utf8=str(tmp / "bad_utf8.jsonl"),
        task_surrogate=str(tmp / "surrogate.jsonl"),
        task_many_bad=str(tmp / "many_bad.jsonl"),
    )


def link_embedded_model(cache: Path, converted: Path) -> None:
    """The run's conversion of the embedded model (the ``embedded_model`` fixture) in ``cache``,
    linked under its own name, which convert_gguf looks for there: no second conversion (30 s on
    2 cores) for a row whose point is its input; rmtree removes the link, not the model."""
    link = cache / "models" / converted.name
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(converted, target_is_directory=True)


def _tripwire(*_args, **_kwargs):
    raise ReachedModelLoading


def _run_esamp(argv: list[str], monkeypatch, capsys, guard: bool) -> tuple[int | str, str]:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # main() sets it; keep this process unchanged
    import esamp.commands.bench.memory
    import esamp.engines.vllm.engine as vllm_engine

    monkeypatch.setattr(esamp.commands.bench.memory, "_memory_source", lambda: ("ram", 16 * GIB, 12 * GIB))
    monkeypatch.setattr(vllm_engine, "VllmEngine", _tripwire)
    if guard:
        import transformers

        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _tripwire)
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", _tripwire)
    try:
        code: int | str = main(argv)
    except SystemExit as exc:
        code = exc.code
    except ReachedModelLoading:
        pytest.fail(f"{argv} was not refused: it reached model loading")
    except BaseException:  # what a user would see as a traceback
        code = "Traceback"
        print("Traceback (from the test)\n" + traceback.format_exc(), file=sys.stderr)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _run_tui(argv: list[str]) -> tuple[int | str, str]:
    args = [a.encode("utf-8", "surrogateescape") for a in argv]  # invalid bytes reach argv as bytes
    try:
        proc = subprocess.run(
            [sys.executable.encode(), b"-m", b"esamp_tui", *args],
            cwd=ROOT,
            capture_output=True,
            stdin=subprocess.DEVNULL,
            timeout=15,
        )
    except subprocess.TimeoutExpired:
        return "timeout: the dashboard started instead of refusing", ""
    return proc.returncode, (proc.stdout + proc.stderr).decode("utf-8", "replace")


@pytest.mark.parametrize("name, argv, needle", CASES, ids=[getattr(c, "values", c)[0] for c in CASES])
def test_bad_input_exits_2_with_a_hint(name, argv, needle, files, monkeypatch, capsys, request):
    if "{truncated_gguf}" in argv and not Path(files["truncated_gguf"]).exists():
        pytest.skip("the embedded model is not installed")
    if "{" in needle:
        needle = needle.format(**files)
    argv = [a.format(**files) if "{" in a and "}" in a else a for a in argv]
    if argv[0] == "esamp-tui":
        code, text = _run_tui(argv[1:])
    else:
        if "slow" in request.keywords:  # needs the real tokenizer
            link_embedded_model(Path(files["tmp"]) / "cache", request.getfixturevalue("embedded_model"))
        monkeypatch.setenv("ESAMP_CACHE_DIR", files["tmp"] + "/cache")
        code, text = _run_esamp(argv[1:], monkeypatch, capsys, guard="slow" not in request.keywords)
    assert "Traceback" not in text, text
    assert code == 2, f"exit status {code}: {text}"
    assert "hint:" in text, text
    assert needle in text, text


def test_invalid_utf8_in_a_real_argv_is_refused_before_loading():
    """The bytes as a shell passes them, through Python's own argv decoding."""
    proc = subprocess.run(
        [sys.executable.encode(), b"-m", b"esamp", b"generate", b"Name a colour \xff now."],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2 and "not valid UTF-8" in err and "byte 0xff" in err
    assert "Traceback" not in err and "loading" not in err
