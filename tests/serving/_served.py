"""Starting and stopping ``esamp serve`` for the serving tests (used by conftest.py and the modules)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from esamp.serving.channel import hold_ports

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 300.0  # a cold start on a busy 2-core machine
RUNNING: list[Served] = []  # the servers up now: a failing test's report shows their logs (conftest.py)
# The log lines a failing test's report keeps from a server's start (``Served.excerpt``).
NOTEWORTHY = ("esamp serve:", "side channel", "ERROR", "WARNING", "Traceback", "Error")
# The dtype of the module whose served samples must equal the library engine's token for token
# (test_serve_live.py). On a CPU with bf16 arithmetic both would run bf16 (launch.default_dtype), and
# a bf16 forward gives another rounding for another batch: the served engine batches the n child
# requests as the frontend delivers them, the library engine all at once, so a near-tie drew
# another token on some runs there. In float32 the two differ far below any tie.
EXACT_DTYPE = "float32"
SLOTS = 8  # the module servers' --slots, and so their batch size (--max-num-seqs)


class Served:
    """A running ``esamp serve`` process and how to reach it (``api_key``: the key it was started
    with, which ``get``/``post`` send unless told ``key=None``; ``env``: variables set for it on
    top of this process's)."""

    def __init__(self, args: list[str], log: Path, api_key: str | None = None, env: dict | None = None) -> None:
        # The API port is held from here until the server stops (vLLM binds it beside the hold,
        # some seconds into its start): found free and let go, any bind to port 0 on the machine
        # (another server's, vLLM's own get_open_port) could be handed it meanwhile.
        self.held = hold_ports(1)
        self.port = self.held.base
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.api_key = api_key
        if api_key:
            args = [*args, "--api-key", api_key]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            **(env or {}),
        }
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own engine core runs as vLLM decides
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "esamp", "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )

    def wait(self) -> Served:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"esamp serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        pytest.fail(f"esamp serve did not answer within {START_TIMEOUT:.0f} s:\n{self.tail()}")

    def request(
        self, method: str, path: str, body: dict | bytes | None = None, key: str | None = "", timeout: float = 120
    ) -> tuple[int, bytes, dict]:
        """(status, body, headers); ``key``: the API key to send ("" = the server's, None = none)."""
        key = self.api_key if key == "" else key
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return r.status, r.read(), {k.lower(): v for k, v in r.headers.items()}
        except urllib.error.HTTPError as err:
            return err.code, err.read(), {k.lower(): v for k, v in err.headers.items()}

    def get(self, path: str, key: str | None = "") -> tuple[int, bytes]:
        return self.request("GET", path, key=key, timeout=30)[:2]

    def post(self, path: str, body: dict | bytes, key: str | None = "") -> tuple[int, bytes]:
        return self.request("POST", path, body, key=key)[:2]

    def excerpt(self, notes: int = 60, lines: int = 30) -> str:
        """What a failing test's report shows of this server's log: its ESamp lines, warnings and
        errors from the start (a side channel that did not start says so there), then its last lines."""
        text = self._log_lines()
        marked = [line for line in text[:-lines] if any(word in line for word in NOTEWORTHY)]
        return "\n".join(line[:400] for line in [*marked[:notes], "...", *text[-lines:]])

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self._log_lines()[-lines:])

    def _log_lines(self) -> list[str]:
        try:
            return self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ["(no log)"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # vLLM stops its engine core on SIGTERM
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.held.close()


def serve(tmp_path_factory, args: list[str], api_key: str | None = None):
    """Start ``esamp serve`` on the embedded model with ``args``; yields it running, stops it after."""
    with started(tmp_path_factory, [args], api_key) as servers:
        yield servers[0]


@contextlib.contextmanager
def started(tmp_path_factory, runs: list[list[str]], api_key: str | None = None, env: dict | None = None):
    """Start one ``esamp serve`` on the embedded model per item of ``runs`` (its arguments), all at
    once, each on its own port and with its own side channel; gives the list once every one
    answers, stops them all after."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM installed")
    from esamp.engines.models import resolve
    from esamp.errors import ModelNotFoundError

    try:
        resolve(None).hf_dir()  # convert the GGUF here (once), not inside the server's start
    except ModelNotFoundError as exc:
        pytest.skip(f"embedded model not installed: {exc}")
    servers: list[Served] = []
    try:
        for args in runs:
            servers.append(Served(args, tmp_path_factory.mktemp("serve") / "server.log", api_key, env))
            RUNNING.append(servers[-1])
        yield [server.wait() for server in servers]
    finally:
        for server in servers:
            server.stop()
            RUNNING.remove(server)


def take_records(server, group: str, timeout: float = 10.0) -> list[tuple]:
    """Every record row of ``group`` this server hands out (taken: read once), once none is still
    on its way from the engine."""
    rows, deadline = [], time.monotonic() + timeout
    while True:
        status, body = server.get(f"/esamp/records?group={group}")
        assert status == 200, body
        data = json.loads(body)
        assert data.get("unreachable", []) == []  # every side channel of the server answered
        rows += [tuple(r) for step in data["steps"] for r in step["rows"]]
        if data["pending"] == 0 or time.monotonic() > deadline:
            return rows
