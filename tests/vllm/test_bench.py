"""``esamp bench`` end to end, as a user runs it: its own process, vLLM's engine cores in theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _vllm_helpers import require_model, require_vllm


@pytest.mark.vllm
def test_bench_runs_three_sides_and_writes_its_json(tmp_path):
    """Baseline, floor (ESamp off on the ESamp engine) and ESamp alternate; the JSON has the
    ratios with their spread, the Distiller's loss and port hits, and the command that made it."""
    require_vllm()
    resolved = require_model()
    out = tmp_path / "bench.json"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "esamp.cli", "bench", "--model", str(resolved.hf_dir()),
           "--workloads", "2xn2x6", "--trials", "2", "--floor", "--max-model-len", "256",
           "--logits", "flat,realistic", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "floor (ESamp engine, ESamp off)" in proc.stdout
    report = json.loads(out.read_text())
    assert report["command"].startswith("esamp bench --model") and "--floor" in report["command"]
    assert report["seed"] is None and set(report["load_seconds"]) == {"baseline", "esamp", "floor"}
    assert report["commit"] and report["calibration"]["alpha"] is not None
    flat, w = report["workloads"]
    assert (flat["logits"], w["logits"]) == ("flat", "realistic") and w["workload"] == "2xn2x6"
    assert "realistic logits: head rows" in proc.stdout
    sides = [t["side"] for t in w["trials"]]
    assert sides == ["baseline", "floor", "esamp", "esamp", "floor", "baseline"]
    assert all(t["tokens"] == 2 * 2 * 6 for t in w["trials"])
    assert w["ratio_min"] <= w["ratio_median"] <= w["ratio_max"]
    assert w["floor_ratio_min"] <= w["floor_ratio_median"] <= w["floor_ratio_max"]
    for t in w["trials"]:
        steered = t["side"] == "esamp"
        assert (t["port_hits"] > 0) == steered and (t["loss_count"] > 0) == steered, t
    assert w["port_hits"] == [2 * 2 * 6] * 2


def test_realistic_calibration_matches_its_target():
    """The head profile found for a target |C| and entropy reproduces them in simulation."""
    import torch

    from esamp.bench import PRESETS, _simulate, calibrate_head

    sigma = (0.5 + torch.rand(5000, generator=torch.Generator().manual_seed(0))).tolist()
    target = dict(candidates=3.0, entropy=2.0)
    filters = PRESETS["default"]["sampling"]
    got = calibrate_head(sigma, target, filters)
    assert abs(got["candidates"] - 3.0) < 1.0 and len(got["factors"]) == 5000
    again = _simulate(torch.tensor(sigma), torch.tensor(got["factors"]), filters, 64,
                      torch.Generator().manual_seed(7))
    assert abs(again[0] - got["candidates"]) < 1.0
