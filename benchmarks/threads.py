"""Reference engine on a CPU shared with other work: tokens/s for 1 and 2 threads, idle and under
load, with OpenMP's default wait policy and with ``OMP_WAIT_POLICY=PASSIVE``.

    .venv/bin/python benchmarks/threads.py --out benchmarks/results/threads-cpu.json

Every configuration runs in a fresh interpreter, because OpenMP reads its wait policy once, when
torch's runtime (libgomp) loads: set after ``import torch`` it changes nothing (``--probe`` shows
it: CPU time burnt by the pool's spinning threads while the main thread sleeps). The loads:

- ``idle``: nothing else started (other users of the machine still show in ``rest_cores``);
- ``busy``: one process spinning in a loop, i.e. one core taken by an unrelated job;
- ``generate``: a second engine with the same threads and policy decoding without pause, i.e.
  two esamp commands (or a dashboard and an eval) on one machine.

Each trial is what ``esamp generate PROMPT -n 4 --max-tokens 48`` does after loading (the same
engine and event loop, ESamp on), with ignore_eos so every trial produces exactly 4 × 48 tokens.
Per configuration the JSON holds each trial's tok/s, the CPU the measured process used
(``own_cores``: 1.0 = one core busy for the whole trial; spinning threads raise it without raising
tok/s) and what the rest of the machine used meanwhile (``rest_cores``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Give three different ways to prove there are infinitely many primes."
POLICIES = ("default", "PASSIVE")
LOADS = ("idle", "busy", "generate")


def _env(policy: str) -> dict:
    """The environment of a measured process: ``default`` (nothing set), ``PASSIVE``/``ACTIVE``
    (``OMP_WAIT_POLICY``), or ``GOMP_SPINCOUNT=N`` (libgomp's spin before it sleeps)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if "=" in policy:
        name, _, value = policy.partition("=")
        env[name] = value
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    return env


def _busy_cores() -> float:
    """Core-seconds the whole machine has spent busy since boot."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


# -- the measured process -------------------------------------------------------------------


def child(threads: int, trials: int, n: int, max_tokens: int, forever: bool, budget_s: float) -> None:
    import torch

    from esamp.core.config import EsampConfig, SamplingConfig
    from esamp.engines.base import run
    from esamp.engines.reference import ReferenceEngine

    engine = ReferenceEngine(threads=threads)
    torch.set_num_threads(threads)  # whatever the engine's default is, measure this count
    sampling = SamplingConfig(n=n, max_tokens=max_tokens, ignore_eos=True)
    esamp = EsampConfig()
    list(run(engine, PROMPT, sampling.model_copy(update={"max_tokens": 4}), esamp))  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    if forever:  # the "second generate" load: decode until killed
        while True:
            list(run(engine, PROMPT, sampling, esamp.steering))
    started = time.perf_counter()
    for trial in range(trials):
        c0, s0, t0 = time.process_time(), _busy_cores(), time.perf_counter()
        tokens = sum(
            ev.type == "token"
            for ev in run(engine, PROMPT, sampling.model_copy(update={"seed": trial}), esamp.steering)
        )
        wall = time.perf_counter() - t0
        own = time.process_time() - c0
        rest = max(_busy_cores() - s0 - own, 0.0)
        print(
            json.dumps(
                {
                    "trial": trial,
                    "tokens": tokens,
                    "seconds": round(wall, 3),
                    "tok_s": round(tokens / wall, 2),
                    "own_cores": round(own / wall, 2),
                    "rest_cores": round(rest / wall, 2),
                }
            ),
            flush=True,
        )
        if time.perf_counter() - started > budget_s:
            break  # a collapsed configuration: its first trials say enough


# -- the driver ------------------------------------------------------------------------------


def _spawn(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _start_load(load: str, threads: int, policy: str, args) -> subprocess.Popen | None:
    if load == "idle":
        return None
    if load == "busy":
        return _spawn(["-c", "while True: pass"], _env("default"))
    proc = _spawn(
        [
            __file__,
            "--child",
            "--forever",
            "--threads",
            str(threads),
            "-n",
            str(args.n),
            "--max-tokens",
            str(args.max_tokens),
        ],
        _env(policy),
    )
    line = proc.stdout.readline()  # wait until it is loaded and decoding
    if not line:
        raise RuntimeError("the load process died before it was ready")
    return proc


def measure(threads: int, policy: str, load: str, args) -> dict:
    load_proc = _start_load(load, threads, policy, args)
    try:
        proc = _spawn(
            [
                __file__,
                "--child",
                "--threads",
                str(threads),
                "--trials",
                str(args.trials),
                "-n",
                str(args.n),
                "--max-tokens",
                str(args.max_tokens),
                "--budget",
                str(args.budget),
            ],
            _env(policy),
        )
        lines = [json.loads(line) for line in proc.stdout]
        proc.wait()
    finally:
        _stop(load_proc)
    trials = [r for r in lines if "trial" in r]
    rates = [t["tok_s"] for t in trials]
    return {
        "threads": threads,
        "wait_policy": policy,
        "load": load,
        "trials": trials,
        "tok_s_median": statistics.median(rates) if rates else None,
        "own_cores_median": statistics.median(t["own_cores"] for t in trials) if trials else None,
        "rest_cores_median": statistics.median(t["rest_cores"] for t in trials) if trials else None,
    }


PROBE = """
import os, sys, time
if sys.argv[1] == "before":
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
import torch
if sys.argv[1] == "after":
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
torch.set_num_threads(2)
a = torch.randn(256, 256)
spent = 0.0
for _ in range(20):
    a @ a
    c0 = time.process_time(); time.sleep(0.02); spent += time.process_time() - c0
print(round(spent * 1000, 1))
"""


def probe() -> dict:
    """CPU milliseconds the OpenMP pool burns during 20 sleeps of 20 ms after a parallel matmul."""
    out = {}
    for when in ("unset", "before", "after"):
        res = subprocess.run(
            [sys.executable, "-c", PROBE, when], env=_env("default"), capture_output=True, text=True, check=True
        )
        out[f"PASSIVE set {when} import torch" if when != "unset" else "not set"] = float(res.stdout.strip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--forever", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=None, help="only this thread count (default 1 and 2)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--loads", default=",".join(LOADS))
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--budget", type=float, default=120.0, help="stop a configuration's trials after this many seconds")
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--probe", action="store_true", help="only the wait-policy probe")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        child(args.threads or 1, args.trials, args.n, args.max_tokens, args.forever, args.budget)
        return

    result = {
        "command": "python benchmarks/threads.py " + " ".join(sys.argv[1:]),
        "probe_cpu_ms_while_sleeping": probe(),
    }
    print(json.dumps(result["probe_cpu_ms_while_sleeping"]), flush=True)
    if args.probe:
        return
    import torch

    result.update(
        workload=f"esamp generate workload: n={args.n} x {args.max_tokens} tokens, ESamp on, ignore_eos",
        device=f"CPU ({platform.processor() or platform.machine()}), {os.cpu_count()} cores",
        versions={
            "torch": torch.__version__,
            "python": platform.python_version(),
            "transformers": __import__("transformers").__version__,
        },
        configs=[],
    )
    thread_counts = [args.threads] if args.threads else [1, 2]
    for load in args.loads.split(","):
        for threads in thread_counts:
            for policy in args.policies.split(","):
                r = measure(threads, policy, load, args)
                result["configs"].append(r)
                print(
                    f"{load:>9} threads={threads} {policy:>8}: {r['tok_s_median']} tok/s "
                    f"(own {r['own_cores_median']} cores, rest of machine {r['rest_cores_median']})",
                    flush=True,
                )
    result["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
