"""Throughput of a served ESamp deployment (``esamp serve``) against plain ``vllm serve``, same load.

Both servers run at once on this machine (each with ``--gpu-memory-utilization`` of every GPU it
uses), started one after the other, each with the same vLLM options: the same model, dtype,
``--max-num-seqs``, ``--max-model-len`` and ``--data-parallel-size``. The plain one is vLLM's own
server with no ESamp option and without ``ESAMP_SERVE`` (esamp's logits-processor entry point, when
installed, stays inert in it: the engine has no ESamp settings). A client on loopback then sends
each workload's requests at once, non-streaming, token-id prompts, ``ignore_eos`` (every sample
runs to its token budget), esamp's filters (T 0.8, top-p 0.95, min-p 0.1), and times a trial from
the first request to the last answer; the count is bounded (a workload's P requests) and so is
the time (``--trial-timeout``). Trials alternate between the servers, the order flipping each
round; the ratio is the median of the per-round ESamp/plain ratios (with min and max).

For the ESamp side the server's own counters (``/esamp/metrics``) are read around each trial: the
rows the Distiller steered per data-parallel rank and the bank-full count, so a trial that was not
steered (or steered on one rank only) shows in the result.

``--logits`` is ``esamp bench``'s (same default): ``flat`` measures the model as loaded (a dummy
model's near-uniform logits, ESamp's worst case), ``realistic`` rescales the LM head first, as
``esamp bench --logits realistic`` does (``esamp.commands.bench.calibrate``), so the served ratio
is read on the head the in-process one is. Both servers then run with esamp bench's worker
extension (``--worker-extension-cls``, its methods called by name) and ``VLLM_SERVER_DEV_MODE=1``,
which gives vLLM's ``POST /collective_rpc``: the plain server's head spreads are read once, the
calibration runs once (its scale refined on the ESamp server's probes, read through the client
engine), and the same factors go to every worker of both servers (vLLM's data-parallel client
sends a call to every rank). Each server's scaled head is read back and checked against the
factors before any trial; attached servers get their loaded head back at the end.

    python benchmarks/serve_bench.py --model qwen2.5-7b:dummy --json out.json
    python benchmarks/serve_bench.py --model qwen2.5-7b:dummy --data-parallel-size 2 --json out-dp2.json
    python benchmarks/serve_bench.py --baseline-url http://127.0.0.1:8001 --esamp-url http://127.0.0.1:8000

``--baseline-url`` / ``--esamp-url`` measure servers that are already running instead; for servers
started with ``--api-key``, set ``ESAMP_API_KEY`` (sent to both, as esamp's own clients do).
Writes a JSON file with the command, commit, device, versions, both servers' command lines and
start times, and every trial.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
API_KEY_ENV = "ESAMP_API_KEY"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM's development routes, /collective_rpc among them
# A scaled head's spread per token may differ from σ·f by this share (bfloat16 rounds each weight).
HEAD_TOLERANCE = 0.02

from esamp.commands.bench import calibrate  # noqa: E402
from esamp.commands.bench.provenance import commit, versions  # noqa: E402
from esamp.commands.bench.run import DEFAULT_LOGITS, LOGITS  # noqa: E402
from esamp.commands.bench.workloads import PRESETS, parse_workload, prompts as make_prompts  # noqa: E402
from esamp.core.config import Filters  # noqa: E402
from esamp.platform import http_client  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="qwen2.5-7b:dummy", help="what esamp serve takes (default: %(default)s)")
    p.add_argument(
        "--workloads", default="16x64,32xn8x256", help="PxL or PxnNxL, comma-separated (default: %(default)s)"
    )
    p.add_argument("--trials", type=int, default=3, help="timed rounds (one trial per server each)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens")
    p.add_argument(
        "--logits",
        choices=LOGITS,
        default=DEFAULT_LOGITS,
        help="the LM head both servers sample from, as esamp bench's --logits: flat (as loaded) or "
        "realistic (rescaled to a real model's candidate count and entropy) (default: %(default)s)",
    )
    p.add_argument("--data-parallel-size", type=int, default=1, help="data-parallel ranks of each server")
    p.add_argument("--max-num-seqs", type=int, default=256, help="both servers; the ESamp one gets as many slots")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.42, help="each server's share of each GPU")
    p.add_argument("--seed", type=int, default=None, help="per-request seeds (request k: seed + k); default none")
    p.add_argument("--port", type=int, default=8100, help="the plain server's port; the ESamp server's is port + 1")
    p.add_argument("--serve-args", default="", help="more vLLM options for both servers (one string)")
    p.add_argument("--esamp-args", default="", help="more esamp serve options for the ESamp server, e.g. '--beta 1.2'")
    p.add_argument("--baseline-url", default=None, help="measure this running plain server instead of starting one")
    p.add_argument("--esamp-url", default=None, help="measure this running esamp serve server instead of starting one")
    p.add_argument("--startup-timeout", type=float, default=1200.0, help="seconds a server may take to start")
    p.add_argument("--trial-timeout", type=float, default=600.0, help="seconds a trial may take")
    p.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a temporary folder)")
    p.add_argument("--json", dest="json_path", default=None, help="where to write the result")
    return p.parse_args(argv)


# -- the servers ----------------------------------------------------------------------------------


class Server:
    """A server this script started (its own process group) or one it was pointed at."""

    def __init__(
        self, name: str, url: str, command: list[str] | None = None, env: dict | None = None, log: Path | None = None
    ) -> None:
        self.name, self.url, self.command, self.log = name, url, command, log
        self.proc = None
        self.start_seconds = None
        if command is not None:
            self.t0 = time.monotonic()
            self.proc = subprocess.Popen(
                command, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT
            )

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the {self.name} server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        if self.proc is not None:
                            self.start_seconds = round(time.monotonic() - self.t0, 1)
                        return
            except OSError:
                pass
            time.sleep(2.0)
        raise RuntimeError(f"the {self.name} server did not start within {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        if self.log is None:
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def common_options(args, served_name: str) -> list[str]:
    """The vLLM options both servers get."""
    out = [
        "--host",
        "127.0.0.1",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",
        str(args.max_model_len),
        "--data-parallel-size",
        str(args.data_parallel_size),
        "--served-model-name",
        served_name,
        "--generation-config",
        "vllm",
    ]
    from esamp.platform.devices import cuda_available

    if cuda_available():
        out += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    return out + shlex.split(args.serve_args)


def head_options(args) -> list[str]:
    """What both servers get for ``--logits realistic``: esamp bench's worker extension, whose
    methods read and rescale the LM head (called through ``/collective_rpc``)."""
    if args.logits != "realistic":
        return []
    from esamp.commands.bench.worker_extension import BENCH_EXTENSION  # imports torch: only when used

    return ["--worker-extension-cls", BENCH_EXTENSION]


def server_commands(args) -> tuple[list[str], list[str], dict]:
    """(the plain server's command, the ESamp server's, the environment of both)."""
    from esamp.commands.serve import launcher  # the launcher esamp serve itself uses
    from esamp.engines.models import resolve

    resolved = resolve(args.model)
    name = resolved.name
    common = common_options(args, name) + head_options(args)
    model_dir = str(resolved.path if resolved.kind == "dummy" else resolved.hf_dir())
    plain = launcher(model_dir) + [*common, "--port", str(args.port)]
    if resolved.kind == "dummy":
        plain += ["--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16"]
    from esamp.platform.threads import prefer_passive_wait

    prefer_passive_wait()  # what esamp serve runs vLLM with; the plain server gets the same
    env = {k: v for k, v in os.environ.items() if k != "ESAMP_SERVE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if args.logits == "realistic":
        env[DEV_MODE_ENV] = "1"
    from esamp.platform.devices import cuda_available

    if not cuda_available():
        plain += ["--enforce-eager"]
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    esamp = [
        sys.executable,
        "-m",
        "esamp",
        "serve",
        args.model,
        "--slots",
        str(args.max_num_seqs),
        *common,
        "--port",
        str(args.port + 1),
        *shlex.split(args.esamp_args),
    ]
    return plain, esamp, env


def start_servers(args, log_dir: Path) -> tuple[Server, Server]:
    plain, esamp, env = server_commands(args)
    # One after the other: each measures the GPU memory it may take while the other holds its own.
    baseline = Server("plain", f"http://127.0.0.1:{args.port}", plain, env, log_dir / "plain.log")
    baseline.wait(args.startup_timeout)
    print(f"plain vLLM server up in {baseline.start_seconds} s", file=sys.stderr, flush=True)
    served = Server("esamp", f"http://127.0.0.1:{args.port + 1}", esamp, env, log_dir / "esamp.log")
    try:
        served.wait(args.startup_timeout)
    except BaseException:
        baseline.stop()
        raise
    print(f"esamp serve server up in {served.start_seconds} s", file=sys.stderr, flush=True)
    return baseline, served


# -- the client -----------------------------------------------------------------------------------


async def post(url: str, path: str, body: dict, timeout: float) -> dict:
    """One JSON request on its own connection (closed after the answer), with the API key if set."""
    parts = urlsplit(url)
    key = os.environ.get(API_KEY_ENV)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    status, payload = await http_client.request(
        parts.hostname,
        parts.port or 80,
        path,
        method="POST",
        headers=headers,
        body=json.dumps(body).encode(),
        timeout=timeout,
    )
    if status != 200:
        raise RuntimeError(f"{path}: HTTP {status}: {payload[:500].decode(errors='replace')}")
    return json.loads(payload)


async def trial(
    url: str, model: str, prompts: list[list[int]], n: int, tokens: int, seed: int | None, timeout: float
) -> dict:
    """Every prompt at once; tokens per second from the first request to the last answer."""
    filters = Filters().model_dump(include={"temperature", "top_p", "min_p"})
    bodies = [
        dict(
            model=model,
            prompt=p,
            n=n,
            max_tokens=tokens,
            ignore_eos=True,
            **filters,
            **({"seed": seed + k} if seed is not None else {}),
        )
        for k, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    replies = await asyncio.wait_for(
        asyncio.gather(*(post(url, "/v1/completions", b, timeout) for b in bodies)), timeout
    )
    seconds = time.perf_counter() - t0
    generated = sum(r["usage"]["completion_tokens"] for r in replies)
    expected = len(prompts) * n * tokens
    if generated != expected:
        raise RuntimeError(f"{url}: {generated} tokens generated, {expected} expected")
    return {"seconds": round(seconds, 4), "tokens": generated, "tok_s": round(generated / seconds, 1)}


def esamp_counters(url: str) -> dict:
    """Rows steered and bank-full counts per rank, from the ESamp server's /esamp/metrics."""
    with urllib.request.urlopen(url + "/esamp/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        head, value = line.rsplit(" ", 1)
        name, _, labels = head.partition("{")
        rank = labels.split('rank="', 1)[1].split('"', 1)[0] if 'rank="' in labels else "0"
        if name in ("esamp_port_hits_total", "esamp_bank_full_total", "esamp_channel_up"):
            out.setdefault(name, {})[rank] = float(value)
    return out


def get_json(url: str) -> dict:
    """A GET with the API key of a keyed server (``ESAMP_API_KEY``), if set."""
    key = os.environ.get(API_KEY_ENV)
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def served_model(url: str) -> str:
    return get_json(url + "/v1/models")["data"][0]["id"]


# -- the realistic head ---------------------------------------------------------------------------


class Workers:
    """A server's vLLM workers, through vLLM's ``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``):
    a method of the worker extension by name, every worker's answer in rank order (those of the
    first data-parallel rank; the call itself reaches every rank). ``workers`` is what
    ``calibrate.head_sigma`` asks of an engine."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def workers(self, method: str, *args) -> list:
        key = os.environ.get(API_KEY_ENV)
        request = urllib.request.Request(
            self.server.url + "/collective_rpc",
            data=json.dumps({"method": method, "args": list(args)}).encode(),
            headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=600) as r:
                body = r.read()
        except urllib.error.HTTPError as err:
            from esamp.commands.bench.worker_extension import BENCH_EXTENSION

            raise RuntimeError(
                f"the {self.server.name} server's /collective_rpc {method}: HTTP {err.code}: "
                f"{err.read()[:300].decode(errors='replace')}\n--logits realistic needs both servers started with "
                f"{DEV_MODE_ENV}=1 and --worker-extension-cls {BENCH_EXTENSION} (as this script starts them), "
                "or --logits flat"
            ) from None
        return json.loads(body)["results"] if body else []

    def scale_head(self, factors: list[float] | None) -> None:
        """Every worker's LM head rows × ``factors`` (None: the head as loaded)."""
        self.workers("esamp_scale_head", factors)


def head_gap(expected: list[float], got: list[float]) -> float:
    """The largest relative gap between a head's spreads and the expected ones (σ·f)."""
    if len(got) != len(expected):
        return math.inf
    return max((abs(g - e) / e for e, g in zip(expected, got) if e > 0), default=0.0)


def realistic_heads(baseline: Server, served: Server, prompt_len: int, vocab: int) -> dict:
    """``--logits realistic``: one calibration (``calibrate.realistic_head``, as ``esamp bench``
    runs it: the plain server's head spreads, the scale refined on the ESamp server), the factors
    to both servers, each server's head read back and checked. The calibration, as a report carries
    it (``heads``: each server's largest gap to the scaled spreads)."""
    from esamp.engines.endpoint import EndpointEngine

    filters = dict(PRESETS["default"]["sampling"])  # esamp's filters: what every trial sends
    sigma = calibrate.head_sigma(Workers(baseline))
    endpoint = EndpointEngine(served.url)
    try:
        factors, cal = calibrate.realistic_head(
            sigma, filters, endpoint, endpoint.esamp.steering, prompt_len, vocab, scale=Workers(served).scale_head
        )
    finally:
        endpoint.close()
    expected = [s * f for s, f in zip(sigma, factors)]
    cal["heads"] = {}
    for server in (baseline, served):
        Workers(server).scale_head(factors)
        cal["heads"][server.name] = round(head_gap(expected, calibrate.head_sigma(Workers(server))), 5)
    wrong = {name: gap for name, gap in cal["heads"].items() if not gap <= HEAD_TOLERANCE}
    if wrong:
        raise RuntimeError(
            f"a server's LM head is not the scaled one (largest gap to σ·f: {wrong}, allowed "
            f"{HEAD_TOLERANCE}): the servers would not sample from the same head"
        )
    print(calibrate.describe(cal), file=sys.stderr, flush=True)
    return cal


def device() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        name = name.decode() if isinstance(name, bytes) else name
        return f"{count} x {name}"
    except Exception:
        import platform

        return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def run(args) -> dict:
    workloads = [parse_workload(w) for w in args.workloads.split(",") if w.strip()]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="serve-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = []
    if args.baseline_url and args.esamp_url:
        baseline, served = Server("plain", args.baseline_url), Server("esamp", args.esamp_url)
    elif args.baseline_url or args.esamp_url:
        raise SystemExit("give both --baseline-url and --esamp-url, or neither")
    else:
        baseline, served = start_servers(args, log_dir)
        started = [baseline, served]
    scaled = []  # attached servers whose head this script rescaled: given back as loaded
    try:
        model = served_model(served.url)
        config = get_json(served.url + "/esamp/config")
        vocab = _vocab(args.model)
        calibration = {}
        if args.logits == "realistic":
            scaled = [] if started else [baseline, served]
            calibration = realistic_heads(baseline, served, args.prompt_len, vocab)
        result = {
            "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            "commit": commit(),
            "device": device(),
            "versions": versions(),
            "model": args.model,
            "logits": args.logits,
            "calibration": calibration,
            "data_parallel_size": config["ranks"],
            "max_num_seqs": args.max_num_seqs,
            "esamp": config["esamp"],
            "servers": {
                s.name: {
                    "url": s.url,
                    "command": shlex.join(s.command) if s.command else None,
                    "start_seconds": s.start_seconds,
                }
                for s in (baseline, served)
            },
            "filters": Filters().model_dump(include={"temperature", "top_p", "min_p"}),
            "seed": args.seed,
            "environment": {
                k: os.environ[k]
                for k in ("OMP_WAIT_POLICY", "VLLM_CPU_KVCACHE_SPACE", "CUDA_VISIBLE_DEVICES")
                if k in os.environ
            },
            "workloads": [],
        }
        for P, n, L in workloads:
            name = f"{P}x{L}" if n == 1 else f"{P}xn{n}x{L}"
            prompts = make_prompts(P, args.prompt_len, vocab, seed=0)
            for server in (baseline, served):  # warm-up: not timed
                asyncio.run(trial(server.url, model, prompts, n, L, args.seed, args.trial_timeout))
            trials = []
            for round_ in range(args.trials):
                order = (baseline, served) if round_ % 2 == 0 else (served, baseline)
                for server in order:
                    before = esamp_counters(served.url) if server is served else None
                    got = asyncio.run(trial(server.url, model, prompts, n, L, args.seed, args.trial_timeout))
                    got.update(side=server.name, round=round_)
                    if before is not None:
                        after = esamp_counters(served.url)
                        got["port_hits_by_rank"] = {
                            r: after["esamp_port_hits_total"].get(r, 0) - before["esamp_port_hits_total"].get(r, 0)
                            for r in after.get("esamp_port_hits_total", {})
                        }
                        got["bank_full"] = sum(after.get("esamp_bank_full_total", {}).values()) - sum(
                            before.get("esamp_bank_full_total", {}).values()
                        )
                    trials.append(got)
                    print(
                        f"{name:<12} round {round_} {server.name:<6} {got['tok_s']:>10.1f} tok/s"
                        + (f"  steered {got['port_hits_by_rank']}" if "port_hits_by_rank" in got else ""),
                        file=sys.stderr,
                        flush=True,
                    )
            ratios = []
            for round_ in range(args.trials):
                side = {t["side"]: t["tok_s"] for t in trials if t["round"] == round_}
                ratios.append(side["esamp"] / side["plain"])
            result["workloads"].append(
                {
                    "name": name,
                    "prompts": P,
                    "n": n,
                    "tokens": L,
                    "trials": trials,
                    "plain_tok_s": statistics.median(t["tok_s"] for t in trials if t["side"] == "plain"),
                    "esamp_tok_s": statistics.median(t["tok_s"] for t in trials if t["side"] == "esamp"),
                    "ratio": {
                        "median": round(statistics.median(ratios), 4),
                        "min": round(min(ratios), 4),
                        "max": round(max(ratios), 4),
                    },
                }
            )
        return result
    finally:
        for server in scaled:
            try:
                Workers(server).scale_head(None)
            except Exception as exc:  # noqa: BLE001 - the measurement stands; say what was left
                print(f"the {server.name} server keeps the scaled head: {exc}", file=sys.stderr)
        for server in started:
            server.stop()


def _vocab(spec: str) -> int:
    from esamp.engines.models import resolve

    resolved = resolve(spec)
    path = resolved.path if resolved.kind == "dummy" else resolved.hf_dir()
    return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except RuntimeError as exc:  # a server that did not start or answer: its own words, no traceback
        print(f"serve_bench.py: {exc}", file=sys.stderr)
        return 1
    print(f"{'logits':>9} {'workload':<12} {'plain tok/s':>12} {'esamp tok/s':>12} {'ratio':>7} {'(min..max)':>14}")
    for w in result["workloads"]:
        r = w["ratio"]
        print(
            f"{result['logits']:>9} {w['name']:<12} {w['plain_tok_s']:>12.1f} {w['esamp_tok_s']:>12.1f} "
            f"{r['median']:>7.3f} {r['min']:>6.3f}..{r['max']:<6.3f}"
        )
    if result["calibration"]:
        print(calibrate.describe(result["calibration"]))
    path = Path(
        args.json_path
        or ROOT
        / "benchmarks"
        / "results"
        / f"serve-{args.model.replace(':', '-')}-dp{result['data_parallel_size']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
