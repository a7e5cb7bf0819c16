"""``benchmarks/host_micro.py`` runs end to end at tiny shapes on the CPU with vLLM kept out of the
process: the MRV2 adapter's work (``esamp.engines.vllm.late``) imports no vLLM, so the micro runs
where the GPU image holds only torch. It measures nothing here; it must only finish and report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Any import of vllm (or the dashboard) fails in the child, as on a machine without them.
BLOCK = r"""
import runpy, sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "textual"):
            raise ImportError(f"{name} is kept out of this process")
        return None

sys.meta_path.insert(0, Block())
sys.argv = ["host_micro.py"] + sys.argv[1:]
runpy.run_path("benchmarks/host_micro.py", run_name="__main__")
"""


def test_the_host_micro_runs_the_late_adapter_without_vllm(tmp_path):
    out = tmp_path / "micro.json"
    args = ["--hidden", "32", "--vocab", "128", "--prompts", "2", "-n", "3", "--max-rows", "16"]
    args += ["--warmup", "2", "--steps", "4", "--rebuilds", "2", "--profile", "2", "--top", "5", "--json", str(out)]
    done = subprocess.run([sys.executable, "-c", BLOCK, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["shape"]["rows"] == 6 and report["steps"] == 4
    assert report["apply_wall_ms"]["median"] > 0 and report["apply_cpu_ms"]["median"] > 0
    assert report["rebuild_apply_wall_ms"]["median"] > 0
    assert report["records_read"] > 0  # the steps' records came back through the record store
    assert {"profile_steady", "profile_rebuild"} <= set(report)
    assert "vllm" not in report["versions"] or report["versions"]["vllm"] is None


def test_the_host_micro_refuses_more_rows_than_the_engine_holds():
    done = subprocess.run(
        [sys.executable, "benchmarks/host_micro.py", "--prompts", "8", "-n", "4", "--max-rows", "16"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "past --max-rows 16" in done.stderr
