"""``esamp bench`` keeps vLLM's output off the terminal: stderr goes to a log beside the JSON while
the engines live, the bench's own lines stay on stdout, and a failure names the log and quotes its
errors. The end-to-end run (tests/engines/vllm/test_bench.py) checks the same on real engines."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from esamp.commands.bench import vllm_log

ROOT = Path(__file__).resolve().parents[2]  # the repository, so the child imports this checkout's esamp

# What vLLM 0.30 wrote on the terminal for a dummy model (skip_tokenizer_init=True): a warning with
# the traceback of an error it caught and carried on from, and a child process's warning.
WARMUP = """\
WARNING 11-27 00:39:22 [base.py:370] Chat template warmup failed
WARNING 11-27 00:39:22 [base.py:370] Traceback (most recent call last):
WARNING 11-27 00:39:22 [base.py:370]   File "/venv/vllm/renderers/base.py", line 187, in get_tokenizer
WARNING 11-27 00:39:22 [base.py:370]     raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
WARNING 11-27 00:39:22 [base.py:370] ValueError: Tokenizer not available when `skip_tokenizer_init=True`
(EngineCore pid=6619) WARNING 11-27 00:39:21 [vllm.py:709] Model Runner V2 requires Triton
W1127 00:33:42.339000 3634 torch/_library/triton.py:53] Triton not available
"""
FAILURE = """\
(Worker pid=78) ERROR 11-27 01:02:03 [multiproc_executor.py:1055]
(EngineCore pid=7) ERROR 11-27 01:02:03 [core.py:1000] EngineCore failed to start.
(EngineCore pid=7) ERROR 11-27 01:02:03 [core.py:1000] Traceback (most recent call last):
(EngineCore pid=7) ERROR 11-27 01:02:03 [core.py:1000]   File "/venv/vllm/v1/engine/core.py", line 90, in __init__
(EngineCore pid=7) ERROR 11-27 01:02:03 [core.py:1000]     raise ValueError("No available memory for the cache blocks.")
(EngineCore pid=7) ERROR 11-27 01:02:03 [core.py:1000] ValueError: No available memory for the cache blocks.
Traceback (most recent call last):
  File "<stdin>", line 1, in <module>
RuntimeError: Engine core initialization failed. See root cause above.
"""


def _child(code: str, tmp_path) -> subprocess.CompletedProcess:
    """Run ``code`` in a Python process of its own, so its stdout and stderr are real file
    descriptors (pytest's capture replaces ``sys.stderr`` with an object off fd 2)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_stderr_goes_to_the_log_inside_the_block_and_comes_back(tmp_path):
    proc = _child(
        """
        import logging, os, subprocess, sys
        from pathlib import Path
        from esamp.commands.bench import vllm_log

        vllm = logging.getLogger("vllm")  # as vLLM configures it: its own handler on sys.stderr
        vllm.addHandler(logging.StreamHandler(sys.stderr))
        vllm.propagate = False
        print("before", file=sys.stderr)
        with vllm_log.stderr_to(Path("sub/bench.log")):
            print("progress line", flush=True)  # the bench's own output: stdout, untouched
            print("python stderr", file=sys.stderr)
            os.write(2, b"fd 2 itself, as C++ and tqdm write\\n")
            vllm.warning("a vLLM warning")
            subprocess.run([sys.executable, "-c", "import sys; print('a child process', file=sys.stderr)"], check=True)
        print("after", file=sys.stderr)
        try:
            with vllm_log.stderr_to(Path("again.log")):
                raise RuntimeError("boom")
        except RuntimeError:
            print("after a failure", file=sys.stderr)
    """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "progress line\n"
    assert proc.stderr == "before\nafter\nafter a failure\n"
    assert (tmp_path / "sub" / "bench.log").read_text().splitlines() == [
        "python stderr",
        "fd 2 itself, as C++ and tqdm write",
        "a vLLM warning",
        "a child process",
    ]


def test_the_errors_of_a_log_leave_out_warnings_and_traceback_frames(tmp_path):
    log = tmp_path / "bench.vllm.log"
    log.write_text(WARMUP)
    assert vllm_log.error_lines(log) == []  # vLLM carried on: nothing failed
    log.write_text(WARMUP + FAILURE + "E1127 01:02:04.000 77 torch/foo.cpp:1] a torch error\n")
    assert vllm_log.error_lines(log, limit=10) == [
        "(EngineCore pid=7) ERROR 11-27 01:02:03 [core.py:1000] EngineCore failed to start.",
        "(EngineCore pid=7) ERROR 11-27 01:02:03 [core.py:1000] ValueError: No available memory for the cache blocks.",
        "RuntimeError: Engine core initialization failed. See root cause above.",
        "E1127 01:02:04.000 77 torch/foo.cpp:1] a torch error",
    ]
    assert len(vllm_log.error_lines(log, limit=2)) == 2
    assert vllm_log.error_lines(tmp_path / "missing.log") == []


def test_the_log_goes_beside_the_json(tmp_path):
    assert vllm_log.log_path(tmp_path / "bench-x.json") == tmp_path / "bench-x.vllm.log"
    assert vllm_log.log_path(tmp_path / "out") == tmp_path / "out.vllm.log"


# The bench with its engines replaced: vLLM's noise on stderr, from this process and a child, the
# bench's lines on stdout; then it fails as an engine core killed mid-run makes it fail, or returns.
BENCH = """
import importlib, subprocess, sys
from pathlib import Path
from esamp.commands import cli
from esamp.core.config import EsampConfig, SamplingConfig

bench_run = importlib.import_module("esamp.commands.bench.run")  # the package exports a function of that name
WARMUP, FAILURE, FAIL = {warmup!r}, {failure!r}, {fail!r}

def plan(args):
    return bench_run.Plan(workloads=[("default", (1, 1, 4))], trials=1, model=None, logits=["flat"],
                          sampling=SamplingConfig(), esamp=EsampConfig(), given_filters={{}}, given_beta=None,
                          share=0.42, max_seqs=1, spread=0.0, path=Path("bench.json"))

def measure(args, plan, loaded, log):
    bench_run._say("loading the baseline engine (plain vLLM)...")
    sys.stderr.write(WARMUP)
    subprocess.run([sys.executable, "-c", f"import sys; sys.stderr.write({{FAILURE if FAIL else ''!r}})"], check=True)
    if FAIL:
        raise RuntimeError("the engine core died")
    bench_run._say(f"wrote {{plan.path}}; vLLM's log: {{log}}")
    return 0

bench_run._plan, bench_run._measure = plan, measure
sys.exit(cli.main(["bench"]))
"""


def test_a_bench_shows_its_own_lines_and_keeps_vllms_in_the_log(tmp_path):
    proc = _child(BENCH.format(warmup=WARMUP, failure=FAILURE, fail=False), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "vLLM's log (its warnings and progress, off this terminal): bench.vllm.log",
        "loading the baseline engine (plain vLLM)...",
        "wrote bench.json; vLLM's log: bench.vllm.log",
    ]
    assert proc.stderr == ""
    assert "Chat template warmup failed" in (tmp_path / "bench.vllm.log").read_text()


def test_a_failed_bench_names_the_log_and_quotes_its_errors(tmp_path):
    proc = _child(BENCH.format(warmup=WARMUP, failure=FAILURE, fail=True), tmp_path)
    assert proc.returncode == 2
    err = proc.stderr
    assert err.startswith("error: esamp bench stopped: RuntimeError: the engine core died\n  hint: ")
    assert "vLLM's log is bench.vllm.log, and its last errors are:" in err
    assert "ValueError: No available memory for the cache blocks." in err
    assert "WARNING" not in err and "Tokenizer" not in err and "Traceback" not in err
    assert "Chat template warmup failed" in (tmp_path / "bench.vllm.log").read_text()
