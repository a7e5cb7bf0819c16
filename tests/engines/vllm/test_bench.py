"""``esamp bench`` end to end, as a user runs it: its own process, vLLM's engine cores in theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from _vllm_helpers import require_model, require_vllm


@pytest.mark.vllm
@pytest.mark.scale  # three engines at once: about 4 minutes on 2 cores
def test_bench_runs_three_sides_and_writes_its_json(tmp_path):
    """Baseline, floor (ESamp off on the ESamp engine) and ESamp alternate; the JSON has the
    ratios with their spread, the Distiller's loss and port hits, and the command that made it.
    vLLM's warnings and progress bars, from every process, go to the log beside the JSON; the
    terminal shows the bench's own lines."""
    require_vllm()
    resolved = require_model()
    out = tmp_path / "bench.json"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [
        sys.executable,
        "-m",
        "esamp",
        "bench",
        "--model",
        str(resolved.hf_dir()),
        "--workloads",
        "2xn2x6",
        "--trials",
        "2",
        "--floor",
        "--max-model-len",
        "256",
        "--logits",
        "flat,realistic",
        "--min-trial-seconds",
        "0.5",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "floor (ESamp engine, ESamp off)" in proc.stdout
    log = tmp_path / "bench.vllm.log"
    assert f"vLLM's log: {log}" in proc.stdout and "trial 1    esamp:" in proc.stdout
    noise = [
        line
        for line in proc.stderr.splitlines()
        if any(mark in line for mark in ("WARNING", "Traceback", "pid=", "Triton", "Loading"))
    ]
    assert noise == [], proc.stderr[-3000:]
    assert "(EngineCore pid=" in log.read_text()  # the engine cores' output is in the log
    report = json.loads(out.read_text())
    assert report["command"].startswith("esamp bench --model") and "--floor" in report["command"]
    assert report["seed"] is None and set(report["load_seconds"]) == {"baseline", "esamp", "floor"}
    assert report["commit"] and report["calibration"]["alpha"] is not None
    # each side's model runner, named in the JSON and the table (vllm-cpu runs V1; a GPU's plain
    # engine runs Model Runner V2 from vLLM 0.25)
    assert set(report["runners"]) == {"baseline", "floor", "esamp"}, report["runners"]
    assert set(report["runners"].values()) <= {"V1", "MRV2"}, report["runners"]
    assert f"model runner: baseline {report['runners']['baseline']}, floor" in proc.stdout
    flat, w = report["workloads"]
    assert (flat["logits"], w["logits"]) == ("flat", "realistic") and w["workload"] == "2xn2x6"
    assert "realistic logits: head rows" in proc.stdout
    sides = [t["side"] for t in w["trials"]]
    assert sides == ["baseline", "floor", "esamp", "esamp", "floor", "baseline"]
    # Every side of every trial runs the same number of passes; how many depends on this machine's
    # speed (a pass under --min-trial-seconds is repeated: rounds_for, tested on its own below).
    rounds = w["rounds"]
    assert rounds >= 1 and all(t["rounds"] == rounds and len(t["pass_tok_s"]) == rounds for t in w["trials"])
    counted = [(t["side"], t["tokens"]) for t in w["trials"]]
    assert all(tokens == 2 * 2 * 6 * rounds for _, tokens in counted), (rounds, counted, proc.stdout[-3000:])
    assert w["ratio_min"] <= w["ratio_median"] <= w["ratio_max"]
    assert w["floor_ratio_min"] <= w["floor_ratio_median"] <= w["floor_ratio_max"]
    for t in w["trials"]:
        steered = t["side"] == "esamp"
        assert (t["port_hits"] > 0) == steered and (t["loss_count"] > 0) == steered, t
        assert (t["drains"] > 0) == steered and 0 <= t["drain_share"] < 1, t  # the record fetches, every pass's
        # the engine process's garbage collections were counted on every side (the bench's extension)
        assert t["gc_collections"] >= 0 and 0 <= t["gc_longest_s"] <= t["gc_seconds"], t
    assert "record fetches" in proc.stdout  # the trial lines of the ESamp side
    assert w["port_hits"] == [2 * 2 * 6 * rounds] * 2


def test_short_workloads_repeat_within_a_trial():
    """Rounds make a trial last at least the asked time; every round runs the whole workload."""
    from esamp.commands.bench.trials import run_interleaved, run_trial
    from esamp.commands.bench.workloads import MAX_ROUNDS, rounds_for
    from esamp.core.config import Steering

    assert rounds_for(0.2, 1.0) == 5 and rounds_for(0.3, 1.0) == 4
    assert rounds_for(2.0, 1.0) == 1 and rounds_for(0.2, 0) == 1
    assert rounds_for(0.0, 1.0) == MAX_ROUNDS

    class Scripted:
        """Each group yields one step and a done event of its tokens."""

        def __init__(self):
            self.running, self.started, self.drained = [], 0, 0

        def start(self, prompt, sampling, steering):
            self.running.append(sampling.n * sampling.max_tokens)
            self.started += 1

        def has_unfinished(self):
            return bool(self.running)

        def step(self):
            from types import SimpleNamespace as NS

            tokens = self.running.pop()
            return [NS(type="step", port_hits=tokens, loss=0.5, candidates=2.0), NS(type="done", tokens=tokens)]

        def drain(self):
            self.drained += 1

    engine = Scripted()
    r = run_trial(engine, [[1, 2], [3, 4]], 2, 6, {}, Steering(), rounds=3)
    assert engine.started == 6 and engine.drained == 1
    assert r["tokens"] == 3 * 2 * 2 * 6 and r["port_hits"] == r["tokens"] and r["loss_count"] == 6
    # Interleaved trials: every side runs the same passes, one side after the other (A B B A ...)
    order = []

    class Logged(Scripted):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def start(self, prompt, sampling, steering):
            if not self.running:
                order.append(self.name)
            super().start(prompt, sampling, steering)

    a, b = Logged("a"), Logged("b")
    records = run_interleaved([("a", a, Steering()), ("b", b, Steering())], [[1, 2]], 1, 4, {}, trials=2, rounds=3)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert [(r["side"], r["trial"]) for r in records] == [("a", 0), ("b", 0), ("b", 1), ("a", 1)]
    assert all(r["tokens"] == 3 * 4 and len(r["pass_tok_s"]) == 3 for r in records)


def test_realistic_calibration_matches_its_target():
    """The head profile found for a target |C| and entropy reproduces them in simulation."""
    import torch

    from esamp.commands.bench.calibrate import _simulate, calibrate_head
    from esamp.commands.bench.workloads import PRESETS

    sigma = (0.5 + torch.rand(5000, generator=torch.Generator().manual_seed(0))).tolist()
    target = dict(candidates=3.0, entropy=2.0)
    filters = PRESETS["default"]["sampling"]
    got = calibrate_head(sigma, target, filters)
    assert abs(got["candidates"] - 3.0) < 1.0 and len(got["factors"]) == 5000
    again = _simulate(torch.tensor(sigma), torch.tensor(got["factors"]), filters, 64, torch.Generator().manual_seed(7))
    assert abs(again[0] - got["candidates"]) < 1.0


def test_trials_are_sized_from_a_full_pass_on_every_side(monkeypatch):
    """A warm-up pass with a one-time cost said nothing of a full pass's length (the 7B 32xn8x256
    case: one-pass trials of 3.5 s where 6 were asked): every side runs the workload once in full,
    untimed, and the first side's time sizes the trials."""
    from types import SimpleNamespace as NS

    from esamp.commands.bench import trials
    from esamp.core.config import Steering

    clock = [0.0]  # the bench's clock, advanced by the engines below
    monkeypatch.setattr(trials, "time", NS(perf_counter=lambda: clock[0], process_time=lambda: 0.0))

    class Timed:
        """A pass lasts 2 ms a token of its budget, plus 0.3 s the first time."""

        def __init__(self):
            self.passes, self.running = [], []

        def start(self, prompt, sampling, steering):
            self.running.append(sampling.max_tokens)

        def has_unfinished(self):
            return bool(self.running)

        def step(self):
            tokens = self.running.pop()
            clock[0] += (0.3 if not self.passes else 0.0) + 0.002 * tokens
            self.passes.append(tokens)
            return [NS(type="done", tokens=tokens)]

        def drain(self):
            pass

    a, b = Timed(), Timed()
    sides = [("a", a, Steering()), ("b", b, Steering())]
    warm = trials.run_trial(a, [[1]], 1, 16, {}, Steering())["seconds"]  # 16 tokens and the one-time cost
    trials.run_trial(b, [[1]], 1, 16, {}, Steering())
    assert warm == 0.332
    # Scaled to 64 tokens the warm-up says 1.33 s, past 4 x 0.25 s; a full pass is 0.128 s: 2 passes a trial.
    assert trials.size_rounds(sides, [[1]], 1, 64, {}, 0.25, warm) == 2
    assert a.passes == [16, 64] and b.passes == [16, 64]  # every side ran it once in full
    assert trials.size_rounds(sides, [[1]], 1, 64, {}, 0.0, warm) == 1 and a.passes == [16, 64]  # no minimum
    assert trials.size_rounds(sides, [[1]], 1, 64, {}, 0.05, warm) == 1 and a.passes == [16, 64]  # warm-up 4x long
