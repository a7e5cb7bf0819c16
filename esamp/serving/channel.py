"""A served engine's side channel: each rank's ESamp counters and novelty records over HTTP.

Under ``esamp serve`` every engine core (one per data-parallel rank) runs this small HTTP server
on ``127.0.0.1:port + rank`` in a thread of its own, beside vLLM's engine loop: the worker that
owns the rank's Distiller bank starts it once its steering is built (``start``, registered by
``esamp.serving.plugin``). It answers

- ``GET /metrics``: the rank's counters in the Prometheus text format (what vLLM's own
  ``/metrics`` speaks), every sample labelled with ``rank``;
- ``GET /records?group=G[,G...]``: the finished step records (per-token Distiller errors, losses)
  of those groups, taken: a record is handed out once. Records of other groups, and other ranks'
  records, are not touched. A read names its groups: there is no "every group".

Only the API server may ask: the channel listens on the loopback interface, and every request must
carry the per-launch secret that ``esamp serve`` puts in the environment of the whole server
(``ESAMP_CHANNEL_SECRET``; never on a command line, which any user of the machine can read) in
the ``X-Esamp-Channel-Secret`` header. Without the secret in its environment the channel does not
start (``/esamp/...`` then answers 503 saying so).

Why a channel per rank: vLLM's ``collective_rpc`` answers for one data-parallel rank only, so the
worker extension cannot gather every rank's counters or records. The API server's middleware
reads each rank's channel and shows them together.

The thread sleeps in ``select`` until a request comes, so an idle channel costs the engine
nothing; a request reads the engine's ESamp counters and its lock-protected record store
(``EngineSteering.metrics`` and ``drain``).

The ports are held from the moment ``esamp serve`` picks them (``hold_ports``) until its server
ends: a rank binds its port tens of seconds later, once vLLM has loaded, and a port that is only
found free in the kernel's ephemeral range can be handed meanwhile to any ``bind(("", 0))`` on
the machine (vLLM's own ``get_open_port``, for one, whose socket then listens for the engine's
life). Held, nothing else can take it, and the rank's channel still binds beside the holder.
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

log = logging.getLogger(__name__)

HOST = "127.0.0.1"  # the channels answer only on this machine; the API server reads them
CHANNEL_SECRET_ENV = "ESAMP_CHANNEL_SECRET"  # set by ``esamp serve``: the side channels' per-launch secret
SECRET_HEADER = "X-Esamp-Channel-Secret"
MAX_GROUPS = 256  # groups one read may name
MAX_GROUP_KEY = 128  # characters of one group key (the server's own ids are 26)
# Seconds a rank keeps trying its port while something else holds it: a port given with
# ``--channel-port`` (or any port off Linux) is only found free before vLLM starts, not held
# (``hold_ports``), and a short-lived socket (a probe, a client's connection) may hold it for a
# moment when the rank binds.
BIND_WAIT = 10.0

# Counter name in the engine's metrics → (Prometheus name, type, help). Written once: the API server's
# aggregate uses these names too.
METRICS = {
    "port_hits": ("esamp_port_hits_total", "counter", "Port hits: rows the Distiller steered (tapped rows delivered)"),
    "train_steps": ("esamp_train_steps_total", "counter", "Engine steps that trained the Distiller"),
    "steps": ("esamp_steps_total", "counter", "Engine steps with ESamp rows"),
    "slots_in_use": ("esamp_slots_in_use", "gauge", "Distiller slots held by prompt groups"),
    "slots_free": ("esamp_slots_free", "gauge", "Distiller slots free"),
    "bank_full": (
        "esamp_bank_full_total",
        "counter",
        "Rows sampled plainly because every Distiller slot was held by a running group",
    ),
    "slots_evicted": ("esamp_slots_evicted_total", "counter", "Idle groups' slots taken for new groups"),
    "graph_replays": ("esamp_graph_replays_total", "counter", "Distiller steps replayed as CUDA graphs"),
    "graph_captures": ("esamp_graph_captures_total", "counter", "CUDA graphs captured"),
    "graph_failures": ("esamp_graph_failures_total", "counter", "CUDA-graph captures that failed"),
    "records_dropped": ("esamp_records_dropped_total", "counter", "Novelty records dropped unread"),
    "loss": ("esamp_distiller_loss", "gauge", "Mean Distiller loss of the latest training steps"),
}


def prometheus(counters: dict, rank: int) -> str:
    """The counters in the Prometheus text exposition format."""
    lines = []
    for key, (name, kind, help_text) in METRICS.items():
        if key not in counters or counters[key] is None:
            continue
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f'{name}{{rank="{rank}"}} {counters[key]}']
    return "\n".join(lines) + "\n"


class Channel:
    def __init__(self, steering, host: str, port: int, rank: int, secret: str) -> None:
        if not secret:
            raise ValueError("a side channel needs a secret")
        self.rank = rank
        channel = self
        expected = secret.encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the http.server interface)
                given = (self.headers.get(SECRET_HEADER) or "").encode()
                if not hmac.compare_digest(given, expected):
                    self._send(
                        403, json.dumps({"error": "this channel answers only its own API server"}), "application/json"
                    )
                    return
                try:
                    self._answer(urlparse(self.path))
                except Exception as exc:  # the engine's state could not be read: say so, keep serving
                    log.exception("ESamp side channel of rank %d: %s failed", channel.rank, self.path.split("?")[0])
                    self._send(500, json.dumps({"error": f"{type(exc).__name__}: {exc}"}), "application/json")

            def _answer(self, url) -> None:
                if url.path == "/metrics":
                    self._send(200, prometheus(steering.metrics(), channel.rank), "text/plain; version=0.0.4")
                elif url.path == "/records":
                    groups = read_groups(parse_qs(url.query).get("group"))
                    if isinstance(groups, str):
                        self._send(400, json.dumps({"error": groups}), "application/json")
                        return
                    out = steering.drain((), groups)
                    self._send(
                        200,
                        json.dumps({"rank": channel.rank, "steps": out["steps"], "pending": out["pending"]}),
                        "application/json",
                    )
                else:
                    self._send(
                        404,
                        json.dumps({"error": f"no such path {url.path}", "paths": ["/metrics", "/records?group=G"]}),
                        "application/json",
                    )

            def _send(self, status: int, body: str, kind: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # requests are not worth a log line each
                pass

        self.server = _bind(host, port, Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name=f"esamp-channel-{rank}", daemon=True)
        self.thread.start()
        log.info("ESamp side channel of rank %d on http://%s:%d", rank, host, port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _bind(host: str, port: int, handler) -> ThreadingHTTPServer:
    """The channel's HTTP server on ``host:port``, trying again for ``BIND_WAIT`` seconds while the
    port is in use (``OSError`` after that, or at once for any other reason)."""
    deadline = time.monotonic() + BIND_WAIT
    while True:
        try:
            return ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


class PortHold:
    """Ports ``base`` .. ``base + count - 1`` on ``host``, each bound by a socket of this process
    that never listens (``hold_ports``)."""

    def __init__(self, base: int, sockets: list[socket.socket]) -> None:
        self.base = base
        self.sockets = sockets

    def keep_across_exec(self) -> None:
        """Let the process that ``exec`` makes of this one (vLLM's API server) go on holding them;
        the engine cores it spawns do not inherit them, and need not."""
        for held in self.sockets:
            os.set_inheritable(held.fileno(), True)

    def close(self) -> None:
        for held in self.sockets:
            held.close()
        self.sockets = []


def hold_ports(count: int, host: str = HOST, tries: int = 50) -> PortHold:
    """``count`` consecutive free ports on ``host``, held by this process until ``close`` (or its
    end, or its ``exec``'s end: ``PortHold.keep_across_exec``).

    Each is bound without ``SO_REUSEADDR``, so a port anything else has bound, listens on or has a
    connection on is refused; then ``SO_REUSEADDR`` is set on the holder. On Linux a listener that
    also sets it (the channel's ``ThreadingHTTPServer`` does) may then bind and listen beside it,
    since the holder never listens, while every other socket on the machine is kept off the port:
    an explicit bind without the flag conflicts, and neither ``bind`` to port 0 nor an outgoing
    connection picks a port that is bound explicitly. Elsewhere a held port would refuse the
    channel too, so the ports are only found free and let go, as before."""
    for _ in range(tries):
        first = socket.socket()
        try:
            first.bind((host, 0))
        except OSError:
            first.close()
            raise
        base = first.getsockname()[1]
        sockets = [first]
        try:
            for i in range(1, count):
                if base + i > 65535:
                    raise OSError(errno.EADDRNOTAVAIL, "past the last port")
                held = socket.socket()
                sockets.append(held)
                held.bind((host, base + i))
        except OSError:
            for held in sockets:
                held.close()
            continue
        hold = PortHold(base, sockets)
        if not sys.platform.startswith("linux"):
            hold.close()
        for held in hold.sockets:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return hold
    raise OSError(errno.EADDRINUSE, f"found no {count} consecutive free ports on {host}")


def read_groups(values: list[str] | None) -> set[str] | str:
    """The groups a read names (``group=G[,G...]``, repeatable), or what is wrong with them."""
    groups = {g for value in values or () for g in value.split(",") if g}
    if not groups:
        return "name the groups whose records you take: /records?group=G[,G...]"
    if len(groups) > MAX_GROUPS:
        return f"{len(groups)} groups in one read: at most {MAX_GROUPS}"
    if any(len(g) > MAX_GROUP_KEY for g in groups):
        return f"a group key longer than {MAX_GROUP_KEY} characters is not one of this server's"
    return groups


def start(steering, settings: dict, vllm_config) -> Channel | None:
    """The channel of this engine core (``steering``: its ``EngineSteering``, or anything with its
    ``metrics()`` and ``drain(release, groups)``), when ``esamp serve`` asked for one
    (``settings["port"]``)."""
    port = settings.get("port")
    if not port:
        return None
    # vLLM keeps a dense model's engine cores at data_parallel_rank 0 and their real place in
    # data_parallel_index (vLLM 0.20 v1/engine/core.py); older configs only have the rank.
    parallel = vllm_config.parallel_config
    rank = int(getattr(parallel, "data_parallel_index", None) or getattr(parallel, "data_parallel_rank", 0) or 0)
    secret = os.environ.get(CHANNEL_SECRET_ENV)
    if not secret:
        log.warning(
            "ESamp side channel of rank %d not started: %s is not set (esamp serve sets it; with a "
            "vllm serve line of your own, set it to a random value)",
            rank,
            CHANNEL_SECRET_ENV,
        )
        return None
    try:
        return Channel(steering, settings.get("host", HOST), int(port) + rank, rank, secret)
    except OSError as exc:  # held by another process for BIND_WAIT seconds, or not allowed
        log.error(
            "ESamp side channel of rank %d not started on %s:%d: %s. This rank's records and counters "
            "cannot be read (/esamp/records lists it as unreachable, esamp_channel_up is 0); restart "
            "the server (esamp serve --channel-port PORT picks the ports)",
            rank,
            settings.get("host", HOST),
            int(port) + rank,
            exc,
        )
        return None
