"""``esamp generate --engine vllm`` as a user runs it: its own process, vLLM's engine core in another."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _vllm_helpers import require_model, require_vllm


@pytest.mark.vllm
def test_generate_json_on_vllm_is_only_json_on_stdout():
    """vLLM's log goes to stderr (warnings only), so ``--json | jq`` reads events and nothing else."""
    require_vllm()
    resolved = require_model()
    # (on a GPU, other tests of this run may still hold memory: the engine takes a small share)
    env = dict(
        os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1", ESAMP_GPU_MEMORY_UTILIZATION="0.25"
    )
    env.pop("VLLM_LOGGING_LEVEL", None)
    env.pop("VLLM_LOGGING_STREAM", None)
    cmd = [
        sys.executable,
        "-m",
        "esamp",
        "generate",
        "--engine",
        "vllm",
        "--model",
        str(resolved.hf_dir()),
        "-n",
        "2",
        "--max-tokens",
        "4",
        "--json",
        "Name a colour.",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = [json.loads(line) for line in proc.stdout.splitlines()]  # every line is an event
    assert sum(e["type"] == "done" for e in events) == 2
    informed = [line for line in proc.stderr.splitlines() if " INFO " in line]
    assert not informed, informed  # (on a GPU with vLLM 0.33, FlashInfer's JIT logged its INFO lines here)
