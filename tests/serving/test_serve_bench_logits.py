"""``benchmarks/serve_bench.py --logits``: the served ratio read on the head ``esamp bench`` reads its
own on. ``realistic`` gives both servers esamp bench's worker extension and vLLM's
``/collective_rpc`` (``VLLM_SERVER_DEV_MODE``), calibrates once (``esamp.commands.bench.calibrate``)
and scales every server's head with the same factors, each read back before any trial.

The option, the servers' commands and the calibration's flow against stand-in servers run
without vLLM's engine; the end-to-end run starts both servers on the embedded model at once
(``scale``: about 3 minutes on 2 cores)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from esamp.commands.bench import calibrate
from esamp.commands.bench.run import DEFAULT_LOGITS, LOGITS
from esamp.commands.bench.worker_extension import BENCH_EXTENSION
from esamp.serving.channel import hold_ports

ROOT = Path(__file__).resolve().parents[2]
PATH = ROOT / "benchmarks" / "serve_bench.py"
PRESET = "qwen2.5-0.5b:dummy"  # a config.json only: resolving it is instant


@pytest.fixture(scope="module")
def serve_bench():
    spec = importlib.util.spec_from_file_location("serve_bench", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def option(command: list[str], name: str):
    found = [command[i + 1] for i, token in enumerate(command) if token == name]
    return found[-1] if found else None


# -- the option ------------------------------------------------------------------------------------


def test_logits_takes_esamp_bench_modes_and_default(serve_bench):
    assert serve_bench.parse_args([]).logits == DEFAULT_LOGITS  # esamp bench's own default
    for mode in LOGITS:
        assert serve_bench.parse_args(["--logits", mode]).logits == mode


def test_an_unknown_logits_mode_is_refused_with_the_flag_named():
    done = subprocess.run(
        [sys.executable, str(PATH), "--logits", "sideways"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "--logits" in done.stderr and "'sideways'" in done.stderr and "realistic" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


# -- the servers' commands -------------------------------------------------------------------------


@pytest.mark.vllm
def test_realistic_gives_both_servers_the_head_methods_and_the_rpc_route(serve_bench, monkeypatch):
    """Both commands name esamp bench's extension, both share the environment with vLLM's
    development routes on, and ``esamp serve`` puts the extension in the vLLM command it runs
    (it takes esamp bench's, a superset of its own); ``flat`` adds none of it."""
    pytest.importorskip("vllm")
    from esamp.commands.serve import EXTENSION, build, configure

    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))  # set back after
    args = serve_bench.parse_args(["--model", PRESET, "--logits", "realistic", "--max-num-seqs", "8"])
    plain, esamp, env = serve_bench.server_commands(args)
    assert option(plain, "--worker-extension-cls") == BENCH_EXTENSION
    assert option(esamp, "--worker-extension-cls") == BENCH_EXTENSION
    assert env[serve_bench.DEV_MODE_ENV] == "1"

    p = argparse.ArgumentParser()
    configure(p)
    served_args, rest = p.parse_known_args(esamp[esamp.index("serve") + 1 :])
    assert option(build(served_args, rest).command, "--worker-extension-cls") == BENCH_EXTENSION

    plain, esamp, env = serve_bench.server_commands(serve_bench.parse_args(["--model", PRESET, "--logits", "flat"]))
    assert "--worker-extension-cls" not in plain + esamp and serve_bench.DEV_MODE_ENV not in env
    served_args, rest = p.parse_known_args(esamp[esamp.index("serve") + 1 :])
    assert option(build(served_args, rest).command, "--worker-extension-cls") == EXTENSION


# -- the calibration's flow, against stand-in servers ----------------------------------------------


class FakeServer:
    """A server's workers as ``/collective_rpc`` sees them: one LM head's spreads, scaled in place
    from the head as loaded (``obeys``: False for a server that ignores the scaling)."""

    def __init__(self, name: str, sigma: list[float], obeys: bool = True) -> None:
        self.name, self.url = name, f"http://{name}"
        self.loaded, self.sigma, self.obeys = list(sigma), list(sigma), obeys
        self.scaled: list = []  # every factors list it was sent

    def rpc(self, method: str, *args):
        if method == "esamp_head_sigma":
            return [list(self.sigma)]
        assert method == "esamp_scale_head", method
        (factors,) = args
        self.scaled.append(factors)
        if self.obeys:
            self.sigma = list(self.loaded) if factors is None else [s * f for s, f in zip(self.loaded, factors)]
        return [None]


@pytest.fixture
def stand_ins(serve_bench, monkeypatch):
    """serve_bench's ``Workers`` on stand-in servers, its client engine a stub, and the refinement
    (which runs probe requests on the ESamp server) replaced by one scaling of the ESamp side;
    ``calibrations`` counts the simulations run."""
    import esamp.engines.endpoint as endpoint

    monkeypatch.setattr(serve_bench.Workers, "workers", lambda self, method, *args: self.server.rpc(method, *args))

    class Endpoint:
        def __init__(self, url):
            self.esamp = argparse.Namespace(steering=None)

        def close(self):
            pass

    monkeypatch.setattr(endpoint, "EndpointEngine", Endpoint)

    def refine(engine, factors, target, prompts, sampling_kw, steering, steps=8, scale=None):
        scale([f * 2.0 for f in factors])
        return [f * 1.5 for f in factors], target, 1.5

    monkeypatch.setattr(calibrate, "refine_scale", refine)
    calibrations = []
    real = calibrate.calibrate_head
    monkeypatch.setattr(calibrate, "calibrate_head", lambda *a, **k: calibrations.append(a) or real(*a, **k))
    return calibrations


SIGMA = [0.02 + 0.001 * (v % 7) for v in range(400)]


def test_realistic_scales_both_servers_alike_from_one_calibration(serve_bench, stand_ins):
    plain, served = FakeServer("plain", SIGMA), FakeServer("esamp", SIGMA)
    cal = serve_bench.realistic_heads(plain, served, prompt_len=8, vocab=400)
    assert len(stand_ins) == 1  # calibrated once
    # the ESamp server took the refinement's trial first; then both got the same factors, last
    assert len(served.scaled) == 2 and len(plain.scaled) == 1
    assert plain.scaled[-1] == served.scaled[-1] and plain.sigma == served.sigma != SIGMA
    assert cal["heads"] == {"plain": 0.0, "esamp": 0.0}
    assert {"alpha", "scale", "simulated_scale", "candidates", "entropy", "measured_candidates", "filters"} <= set(cal)
    assert cal["scale"] == pytest.approx(cal["simulated_scale"] * 1.5)
    json.dumps(cal)  # goes into the report as it is


@pytest.mark.parametrize("ignores", ["plain", "esamp"])
def test_a_server_whose_head_did_not_take_the_factors_stops_the_bench(serve_bench, stand_ins, ignores):
    plain = FakeServer("plain", SIGMA, obeys=ignores != "plain")
    served = FakeServer("esamp", SIGMA, obeys=ignores != "esamp")
    with pytest.raises(RuntimeError, match=f"'{ignores}'"):
        serve_bench.realistic_heads(plain, served, prompt_len=8, vocab=400)


# -- end to end: both servers on the embedded model ------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.scale  # a plain vLLM server and esamp serve at once
def test_serve_bench_realistic_scales_both_started_servers(tmp_path):
    pytest.importorskip("vllm")
    from esamp.engines.models import resolve
    from esamp.errors import ModelNotFoundError

    try:
        resolve(None).hf_dir()  # the GGUF converted here (once), not inside a server's start
    except ModelNotFoundError as exc:
        pytest.skip(f"embedded model not installed: {exc}")
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # each server's engine core as vLLM runs it
    # serve_bench's two servers listen on P and P + 1, the second a minute after the first: both
    # held until the run ends (each binds beside the hold), so nothing else is handed them meanwhile
    ports = hold_ports(2)
    done = subprocess.run(
        [
            sys.executable,
            str(PATH),
            "--model",
            "embedded",
            "--logits",
            "realistic",
            "--workloads",
            "2xn2x8",
            "--trials",
            "1",
            "--max-num-seqs",
            "8",
            "--max-model-len",
            "512",
            "--port",
            str(ports.base),
            "--startup-timeout",
            "400",
            "--log-dir",
            str(tmp_path / "logs"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    ports.close()
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert done.returncode == 0, done.stderr[-3000:] + logs
    result = json.loads(out.read_text())
    assert result["logits"] == "realistic"
    cal = result["calibration"]
    assert cal["alpha"] is not None and cal["measured_candidates"] > 0
    # both servers' workers hold the scaled head (read back from each after the scaling)
    assert set(cal["heads"]) == {"plain", "esamp"}
    assert all(gap <= 0.02 for gap in cal["heads"].values()), cal["heads"]
    for side in ("plain", "esamp"):
        assert f"--worker-extension-cls {BENCH_EXTENSION}" in result["servers"][side]["command"]
    (workload,) = result["workloads"]
    assert all(t["tokens"] == 2 * 2 * 8 for t in workload["trials"])
    assert "realistic 2xn2x8" in done.stdout and "realistic logits: head rows" in done.stdout
