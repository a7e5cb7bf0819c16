"""The API server's ESamp middleware, as ASGI, against a stand-in for vLLM's app and two ranks' real
side channels (``esamp.serving.channel.Channel`` over stand-in processors). No engine needed:
it runs in a few seconds."""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from esamp.core import payload as pl
from esamp.core.config import EsampConfig
from esamp.engines.vllm import settings as es
from esamp.serving.channel import CHANNEL_SECRET_ENV, SECRET_HEADER, Channel
from esamp.serving.metrics import parse
from esamp.serving.middleware import OPEN, EsampMiddleware

SECRET = "s3cret-for-the-test"


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv(CHANNEL_SECRET_ENV, SECRET)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


class FakeProcessor:
    """What a channel reads from the logits processor: counters, and records taken per group."""

    def __init__(self, rank: int, groups: dict[str, int]) -> None:
        self.rank = rank
        self.records = [{"step": 1, "time": 0.0, "rows": [[g, 0, 0, 0.5, 9] for g in groups], "loss": dict(groups)}]

    def metrics(self) -> dict:
        return {"port_hits": 10 * (self.rank + 1), "steps": 3, "slots_in_use": 1, "slots_free": 7, "loss": 0.25}

    def drain(self, release, groups):
        assert groups, "a channel never takes every group's records"
        mine = [{**r, "rows": [x for x in r["rows"] if x[0] in groups]} for r in self.records]
        self.records = [{**r, "rows": [x for x in r["rows"] if x[0] not in groups]} for r in self.records]
        return {"steps": [r for r in mine if r["rows"]], "pending": 0}


class FakeEngine:
    """vLLM's engine client, as far as the middleware uses it: ``collective_rpc`` and ``errored``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.errored = False

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append((method, args))
        return [len(args[0])]


class FakeVllm:
    """vLLM's app as the middleware sees it: answers 200 (a stream when asked) and remembers what
    reached it."""

    def __init__(
        self,
        ranks: int,
        port: int | None,
        hold: asyncio.Event | None = None,
        api_key: list[str] | None = None,
        server=None,
    ) -> None:
        server_cfg = {"records_requested": True, "host": "127.0.0.1", "port": port} if port else None
        self.engine = FakeEngine()
        self.state = SimpleNamespace(
            vllm_config=SimpleNamespace(
                additional_config={
                    "esamp": EsampConfig(slots=8).model_dump(),
                    **({"esamp_server": server_cfg} if server_cfg else {}),
                },
                parallel_config=SimpleNamespace(data_parallel_size=ranks),
                model_config=SimpleNamespace(
                    hf_config=SimpleNamespace(hidden_size=16, num_hidden_layers=2),
                    served_model_name=["tiny"],
                    model="/models/tiny",
                    max_model_len=256,
                ),
            ),
            args=SimpleNamespace(api_key=api_key),
            engine_client=self.engine,
            **({"server": server} if server is not None else {}),
        )
        self.seen: list[tuple[dict, bytes]] = []
        self.prepared: list[str] = []  # the group of every prompt the engine steered
        self.params: list = []  # every prompt's params, as prepare left them
        self.hold = hold

    def prepare(self, body: bytes) -> None:
        """What vLLM does with a request the middleware sent on: ``prepare`` for each prompt."""
        try:
            request = json.loads(body)
            xargs = request.get("vllm_xargs")
        except (ValueError, AttributeError):
            return
        if not xargs or "esamp_group" not in xargs:
            return
        prompts = request.get("prompt")
        for _ in prompts if isinstance(prompts, list) else [prompts]:
            params = SimpleNamespace(
                n=int(request.get("n", 1)),
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                min_p=0.0,
                seed=None,
                repetition_penalty=1.0,
                presence_penalty=0.0,
                frequency_penalty=0.0,
                extra_args=dict(xargs),
            )
            es.prepare(params)
            self.params.append(params)
            self.prepared.append(params.extra_args["esamp_group"])

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append((dict(scope), body))
        self.prepare(body)
        stream = b'"stream": true' in body
        if stream:
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})
        if self.hold is not None:
            await self.hold.wait()
        if stream:
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def call(middleware, app, method, path, body=b"", headers=(), query=b"", json_body=True, full=False):
    headers = [*headers, *([(b"content-type", b"application/json")] if json_body else [])]
    scope = {"type": "http", "method": method, "path": path, "query_string": query, "headers": headers, "app": app}
    chunks = [body[i : i + 7] for i in range(0, len(body), 7)] or [b""]  # a body in several messages
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # the client stays connected

    async def send(message):
        sent.append(message)

    await middleware(scope, receive, send)
    status, content = sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])
    if full:
        return status, content, dict(sent[0].get("headers", []))
    return status, content


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def ranks(held_port):
    port = held_port(2)
    channels = [Channel(FakeProcessor(r, {f"g{r}": 0.1 * (r + 1)}), "127.0.0.1", port + r, r, SECRET) for r in range(2)]
    yield port, channels
    for c in channels:
        try:
            c.close()
        except Exception:
            pass


def test_metrics_of_every_rank_in_one_prometheus_text(ranks):
    port, channels = ranks
    app = FakeVllm(2, port)
    middleware = EsampMiddleware(app)
    status, body = run(call(middleware, app, "GET", "/esamp/metrics"))
    assert status == 200
    text = body.decode()
    families = parse(text)
    assert text.count("# TYPE esamp_port_hits_total counter") == 1  # one header per family
    assert families["esamp_port_hits_total"]["samples"] == [('{rank="0"}', "10"), ('{rank="1"}', "20")]
    assert families["esamp_bank_full_total"]["samples"] == [('{rank="0"}', "0"), ('{rank="1"}', "0")]
    assert families["esamp_channel_up"]["samples"] == [('{rank="0"}', "1"), ('{rank="1"}', "1")]
    channels[1].close()  # a rank that does not answer is marked down; the others still show
    status, body = run(call(middleware, app, "GET", "/esamp/metrics"))
    families = parse(body.decode())
    assert families["esamp_channel_up"]["samples"] == [('{rank="0"}', "1"), ('{rank="1"}', "0")]
    assert families["esamp_port_hits_total"]["samples"] == [('{rank="0"}', "10")]
    prometheus = pytest.importorskip("prometheus_client.parser")
    names = {f.name for f in prometheus.text_string_to_metric_families(body.decode())}
    assert {"esamp_port_hits", "esamp_channel_up", "esamp_distiller_loss"} <= names


def test_records_come_from_every_rank_once(ranks):
    port, channels = ranks
    app = FakeVllm(2, port)
    middleware = EsampMiddleware(app)
    status, body = run(call(middleware, app, "GET", "/esamp/records", query=b"group=g0,g1"))
    data = json.loads(body)
    assert status == 200 and data["pending"] == 0 and data["unreachable"] == []
    assert sorted((s["rank"], s["rows"][0][0]) for s in data["steps"]) == [(0, "g0"), (1, "g1")]
    _, body = run(call(middleware, app, "GET", "/esamp/records", query=b"group=g0,g1"))
    assert json.loads(body)["steps"] == []  # taken
    channels[0].close()
    _, body = run(call(middleware, app, "GET", "/esamp/records", query=b"group=g0"))
    assert json.loads(body)["unreachable"] == [0]  # the client knows it has not seen everything


def test_a_rank_whose_channel_goes_silent_is_logged_once_with_why_and_again_when_it_answers(ranks, caplog):
    port, channels = ranks
    app = FakeVllm(2, port)
    middleware = EsampMiddleware(app)
    caplog.set_level("INFO", logger="esamp.serving.middleware")
    run(call(middleware, app, "GET", "/esamp/metrics"))
    assert not caplog.records  # every rank answered: nothing to say
    channels[1].close()
    for _ in range(3):
        run(call(middleware, app, "GET", "/esamp/metrics"))
    silent = [r.getMessage() for r in caplog.records]
    assert len(silent) == 1 and f"rank 1 on 127.0.0.1:{port + 1} did not answer" in silent[0]
    assert "Error" in silent[0]  # why: the connection was refused
    channels[1] = Channel(FakeProcessor(1, {}), "127.0.0.1", port + 1, 1, SECRET)
    run(call(middleware, app, "GET", "/esamp/metrics"))
    assert "rank 1" in caplog.records[-1].getMessage() and "answers again" in caplog.records[-1].getMessage()


class FailingProcessor(FakeProcessor):
    def metrics(self) -> dict:
        raise RuntimeError("the counters could not be read")


def test_a_channel_whose_engine_state_cannot_be_read_answers_500_and_keeps_serving(caplog, held_port):
    port = held_port()
    channel = Channel(FailingProcessor(0, {"g0": 0.1}), "127.0.0.1", port, 0, SECRET)
    try:
        caplog.set_level("ERROR", logger="esamp.serving.channel")
        status, body = channel_get(port, "/metrics", SECRET)
        assert status == 500 and "the counters could not be read" in json.loads(body)["error"]
        assert any("/metrics failed" in r.getMessage() for r in caplog.records)  # with its traceback
        status, body = channel_get(port, "/records?group=g0", SECRET)  # the next request is served
        assert status == 200 and json.loads(body)["steps"][0]["rows"][0][0] == "g0"
    finally:
        channel.close()


def test_a_channel_waits_for_a_port_held_a_moment_and_says_what_to_do_when_it_stays_held(
    monkeypatch, caplog, held_port
):
    import socket
    import threading

    from esamp.serving import channel

    port = held_port()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a listener beside the hold, as a rank's
    holder.bind(("127.0.0.1", port))
    holder.listen()
    threading.Timer(0.5, holder.close).start()  # a socket that lets go of the port soon after the rank starts
    config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0))
    started = channel.start(FakeProcessor(0, {}), {"port": port}, config)
    try:
        assert started is not None and channel_get(port, "/metrics", SECRET)[0] == 200
    finally:
        started.close()
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the connection just served may linger
    held.bind(("127.0.0.1", port))
    held.listen()
    monkeypatch.setattr(channel, "BIND_WAIT", 0.3)
    caplog.set_level("ERROR", logger="esamp.serving.channel")
    try:
        assert channel.start(FakeProcessor(0, {}), {"port": port}, config) is None
    finally:
        held.close()
    said = caplog.records[-1].getMessage()
    assert f"rank 0 not started on 127.0.0.1:{port}" in said and "--channel-port" in said


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ports are held on Linux only")
def test_held_ports_are_nobody_elses_until_their_ranks_bind_them(held_port):
    """What esamp serve holds from its start (its API port and the channels' ports: a rank binds
    its port tens of seconds later) is refused to every other socket on the machine, explicit
    binds and binds to port 0 alike, and a rank's channel still binds and answers beside it."""
    import socket

    port = held_port(2)
    for taken in (port, port + 1):
        for address in ("127.0.0.1", ""):
            with socket.socket() as other, pytest.raises(OSError):
                other.bind((address, taken))
    picked = set()
    for _ in range(20000):  # found free and let go, a port is handed to one such bind in ~14,000
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            picked.add(other.getsockname()[1])
    assert not picked & {port, port + 1}
    channels = [Channel(FakeProcessor(r, {f"g{r}": 0.1}), "127.0.0.1", port + r, r, SECRET) for r in range(2)]
    try:
        assert [channel_get(port + r, "/metrics", SECRET)[0] for r in range(2)] == [200, 200]
    finally:
        for c in channels:
            c.close()


def channel_get(port: int, path: str, secret: str | None) -> tuple[int, bytes]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", headers={SECRET_HEADER: secret} if secret is not None else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_a_side_channel_answers_only_its_api_server_and_only_for_named_groups(ranks, monkeypatch):
    port, channels = ranks
    assert channels[0].server.server_address[0] == "127.0.0.1"  # loopback only
    for secret in (None, "", "guess", SECRET + "x"):
        for path in ("/metrics", "/records?group=g0"):
            assert channel_get(port, path, secret)[0] == 403, (secret, path)
    status, body = channel_get(port, "/records", SECRET)
    assert status == 400 and b"name the groups" in body  # no "every group's records"
    status, body = channel_get(port, "/records?group=" + ",".join(f"x{i}" for i in range(300)), SECRET)
    assert status == 400 and b"at most" in body
    assert channel_get(port, "/records?group=" + "y" * 200, SECRET)[0] == 400
    status, body = channel_get(port, "/records?group=g0", SECRET)
    assert status == 200 and json.loads(body)["steps"][0]["rows"][0][0] == "g0"
    from esamp.serving import channel

    monkeypatch.delenv(CHANNEL_SECRET_ENV)  # without the secret in its environment: no channel
    config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_index=0))
    assert channel.start(FakeProcessor(0, {}), {"port": port + 2}, config) is None  # never bound
    app = FakeVllm(1, port)
    status, body = run(call(EsampMiddleware(app), app, "GET", "/esamp/metrics"))
    assert status == 503 and CHANNEL_SECRET_ENV in json.loads(body)["error"]["message"]


def test_config_and_the_routes_errors(ranks):
    port, _ = ranks
    app = FakeVllm(2, port)
    middleware = EsampMiddleware(app)
    status, body = run(call(middleware, app, "GET", "/esamp/config"))
    config = json.loads(body)
    assert status == 200 and config["ranks"] == 2 and config["model"] == "tiny" and config["esamp"]["slots"] == 8
    assert config["channels"] == [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    assert run(call(middleware, app, "GET", "/esamp/other"))[0] == 404
    assert run(call(middleware, app, "POST", "/esamp/metrics"))[0] == 405
    status, body = run(call(middleware, app, "GET", "/esamp/records"))
    assert status == 400 and json.loads(body)["error"]["param"] == "group"
    plain = FakeVllm(1, None)  # a vLLM server without esamp serve's side channel
    status, body = run(call(EsampMiddleware(plain), plain, "GET", "/esamp/metrics"))
    assert status == 503 and "esamp serve" in json.loads(body)["error"]["message"]
    assert app.seen == []  # none of these reached vLLM


# -- the API key --------------------------------------------------------------------------------

GUARDED = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("POST", "/invocations"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
    ("GET", "/redoc"),
    ("GET", "/load"),
    ("GET", "/version"),
    ("POST", "/pooling"),
    ("POST", "/score"),
    ("POST", "/rerank"),
    ("POST", "/v1/responses"),
    ("POST", "/inference/v1/generate"),
    ("POST", "/scale_elastic_ep"),
    ("GET", "/esamp/records"),
    ("GET", "/esamp/config"),
    ("GET", "/a-route-vllm-adds-one-day"),
]


@pytest.mark.parametrize("method, path", GUARDED)
def test_with_an_api_key_every_route_but_health_and_metrics_needs_it(ranks, method, path):
    port, _ = ranks
    app = FakeVllm(1, port, api_key=["k1", "k2"])
    middleware = EsampMiddleware(app)
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    for headers in (
        [],
        [(b"authorization", b"Bearer wrong")],
        [(b"authorization", b"Basic k1")],
        [(b"authorization", b"k1")],
    ):
        status, data, got = run(
            call(middleware, app, method, path, body, headers=headers, query=b"group=g0", full=True)
        )
        error = json.loads(data)["error"]
        assert status == 401 and error["code"] == 401 and "--api-key" in error["message"], (path, headers)
        assert got[b"www-authenticate"] == b"Bearer"
    assert app.seen == []  # nothing reached vLLM
    for key in (b"k1", b"k2"):
        status, _ = run(
            call(middleware, app, method, path, body, headers=[(b"authorization", b"Bearer " + key)], query=b"group=g0")
        )
        assert status != 401, path


@pytest.mark.parametrize("path", sorted(OPEN))
def test_health_checks_and_counters_stay_open(ranks, path):
    port, _ = ranks
    app = FakeVllm(1, port, api_key=["k1"])
    status, _ = run(call(EsampMiddleware(app), app, "GET", path))
    assert status == 200


def test_cors_preflights_and_servers_without_a_key_pass(ranks, monkeypatch):
    port, _ = ranks
    app = FakeVllm(1, port, api_key=["k1"])
    assert run(call(EsampMiddleware(app), app, "OPTIONS", "/v1/completions"))[0] == 200
    open_app = FakeVllm(1, port)
    assert run(call(EsampMiddleware(open_app), open_app, "GET", "/v1/models"))[0] == 200
    monkeypatch.setenv("VLLM_API_KEY", "from-env")  # vLLM's own fallback for --api-key
    env_app = FakeVllm(1, port)
    middleware = EsampMiddleware(env_app)
    assert run(call(middleware, env_app, "GET", "/v1/models"))[0] == 401
    assert (
        run(call(middleware, env_app, "GET", "/v1/models", headers=[(b"authorization", b"Bearer from-env")]))[0] == 200
    )


@pytest.mark.parametrize(
    "raw, taken, refused",
    [
        ('["k1", "k2"]', [b"k1", b"k2"], [b"from-env", b"k3"]),  # esamp serve's list wins over VLLM_API_KEY
        ("not a list", [b"not a list"], [b"from-env", b""]),  # malformed: taken whole, never open
        ("[]", [b"[]"], [b"from-env", b""]),
    ],
)
def test_keys_from_the_environment_never_leave_the_server_open(monkeypatch, raw, taken, refused):
    from esamp.serving.middleware import KEYS_ENV

    monkeypatch.setenv(KEYS_ENV, raw)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    app = FakeVllm(1, None)
    middleware = EsampMiddleware(app)
    for key in taken:
        assert run(call(middleware, app, "GET", "/v1/models", headers=[(b"authorization", b"Bearer " + key)]))[0] == 200
    for key in refused:
        assert run(call(middleware, app, "GET", "/v1/models", headers=[(b"authorization", b"Bearer " + key)]))[0] == 401


def test_a_websocket_without_the_key_is_closed():
    app = FakeVllm(1, None, api_key=["k1"])
    sent = []

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    run(EsampMiddleware(app)({"type": "websocket", "path": "/v1/realtime", "headers": [], "app": app}, receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "API key required"}] and app.seen == []


# -- groups: the server's, one per request; freed when the request ends --------------------------


def completion(**fields) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields}).encode()


def xargs_of(body: bytes) -> dict:
    return json.loads(body).get("vllm_xargs") or {}


def test_each_steered_request_gets_an_unguessable_group_of_its_own(monkeypatch):
    monkeypatch.setenv(es.SERVE_ENV, "1")
    app = FakeVllm(1, 9)
    middleware = EsampMiddleware(app)
    groups = []
    for _ in range(2):
        status, _, headers = run(call(middleware, app, "POST", "/v1/completions", completion(n=2), full=True))
        group = headers[b"x-esamp-group"].decode()
        ticket = xargs_of(app.seen[-1][1])["esamp_group"]  # what rode to the engine: the private ticket
        assert status == 200 and app.prepared[-1] == group and ticket != group and group not in ticket
        groups.append(group)
    assert groups[0] != groups[1] and all(len(g) >= 24 for g in groups)
    assert len(es.ISSUED) == 0  # nothing kept once the requests ended
    assert app.engine.calls == [("esamp_release", ([groups[0]],)), ("esamp_release", ([groups[1]],))]
    # ESamp off: no group, nothing to free
    status, _, headers = run(
        call(middleware, app, "POST", "/v1/completions", completion(vllm_xargs={"esamp": "off"}), full=True)
    )
    assert status == 200 and b"x-esamp-group" not in headers and "esamp_group" not in xargs_of(app.seen[-1][1])
    assert len(app.engine.calls) == 2


@pytest.mark.parametrize(
    "xargs, words",
    [
        ({"esamp_group": "someone-elses"}, ["esamp_group", "set by the server", "X-Esamp-Group"]),
        ({"esamp_sample": 1}, ["esamp_sample", "set by the server"]),
        ({"esamp_seed": 3, "esamp_n": 2}, ["esamp_n, esamp_seed"]),
        ({"esamp_temperature": 0.5, "esamp_group": "x"}, ["esamp_temperature"]),
    ],
)
def test_a_request_cannot_name_or_join_a_group(monkeypatch, xargs, words):
    monkeypatch.setenv(es.SERVE_ENV, "1")
    app = FakeVllm(1, 9)
    for path in ("/v1/completions", "/invocations"):
        status, body = run(call(EsampMiddleware(app), app, "POST", path, completion(vllm_xargs=xargs)))
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == "vllm_xargs", path
        for word in words:
            assert word in error["message"], error["message"]
    assert app.seen == []


def test_the_engine_steers_only_groups_the_middleware_issued(monkeypatch):
    """``prepare`` (vLLM's check of every request, on every route): a group only for a request that
    carries a ticket the middleware issued for a request in flight. A group any client names, the
    id of a running group included, is refused with the same answer; every key the engine sets is
    refused; and a request without a ticket (a route the middleware does not steer) is sampled
    plainly, holding no Distiller slot."""
    monkeypatch.setenv(es.SERVE_ENV, "1")

    class Params(SimpleNamespace):  # like vLLM's SamplingParams, it takes a weak reference
        pass

    def params(**extra):
        return Params(
            n=2,
            temperature=0.7,
            top_p=0.9,
            top_k=0,
            min_p=0.0,
            seed=None,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            extra_args=extra or None,
        )

    issued = es.ISSUED.issue()  # what the middleware writes: the ticket; the client sees the group
    answers = set()
    for extra in (
        {"esamp_group": issued.group},
        {"esamp_group": "eg-not-running"},
        {"esamp_sample": 0},
        {"esamp_temperature": 0.5, "esamp_group": issued.ticket},
    ):
        with pytest.raises(ValueError, match="set by the server") as err:
            es.prepare(params(**extra))
        answers.add(str(err.value))
    assert len(answers) == 3  # the group's answer is one, running or not; esamp_sample's, esamp_temperature's
    first, second = params(esamp_group=issued.ticket), params(esamp_group=issued.ticket)
    es.prepare(first)
    es.prepare(second)
    group = issued.group
    assert (first.extra_args["esamp_group"], second.extra_args["esamp_group"]) == (group, group + ".1")
    assert first.top_p == 1.0 and first.extra_args["esamp_top_p"] == 0.9  # steered: the filters moved
    before = dict(first.extra_args)
    es.prepare(first)  # the same params again: unchanged
    assert first.extra_args == before
    assert es.ISSUED.end(issued.ticket) == [group, group + ".1"] and issued.ticket not in es.ISSUED
    with pytest.raises(ValueError):
        es.prepare(params(esamp_group=issued.ticket))  # ended: no longer anyone's
    plain = params()
    es.prepare(plain)  # no ticket: plain sampling with its own filters, no group
    assert plain.extra_args is None and plain.top_p == 0.9
    with pytest.raises(ValueError, match="served without ESamp") as err:
        es.prepare(params(esamp_beta=1.0))  # asks for ESamp where it cannot be had: told so
    assert "/v1/completions" in str(err.value)
    off = params(esamp="off")
    es.prepare(off)
    assert off.top_p == 0.9


def count_decodes(monkeypatch) -> dict:
    """Counts ``payload.decode`` calls (every decode of a request's settings goes through it)."""
    calls = {"n": 0}
    decode = pl.decode

    def counted(extra):
        calls["n"] += 1
        return decode(extra)

    monkeypatch.setattr(pl, "decode", counted)
    return calls


@pytest.mark.parametrize(
    "fields",
    [
        dict(n=2, vllm_xargs={"esamp_beta": 1.2, "esamp_records": "on"}),
        dict(n=3, prompt=["a", "b"], vllm_xargs={"esamp_mix": "unsharpened"}),
        dict(n=2),
    ],
)
def test_a_served_requests_settings_are_decoded_once_in_the_api_server(monkeypatch, fields):
    """Admission decodes a request's vllm_xargs; the ticket holds what it checked, and prepare (for
    each prompt) takes that instead of decoding again. The engine still gets the request's settings,
    and the real filters as vLLM made them."""
    monkeypatch.setenv(es.SERVE_ENV, "1")
    app = FakeVllm(1, 9)
    calls = count_decodes(monkeypatch)
    status, _ = run(call(EsampMiddleware(app), app, "POST", "/v1/completions", completion(**fields)))
    decodes = calls["n"]
    assert status == 200 and decodes == 1
    assert len(app.params) == len(fields.get("prompt", [1]))
    sent = pl.decode(fields["vllm_xargs"]) if "vllm_xargs" in fields else pl.Payload()  # none: the server's defaults
    for params in app.params:
        got = pl.decode(params.extra_args)
        assert got.steering == sent.steering and got.records == sent.records
        assert got.n == fields["n"] and got.filters is not None and params.top_p == 1.0


def test_prepare_trusts_held_settings_only_for_the_xargs_admission_read(monkeypatch):
    """Held settings stand for the exact vllm_xargs admission read: params carrying other ones (vLLM
    adds keys of its own, such as kv_transfer_params) are decoded from what they carry."""
    monkeypatch.setenv(es.SERVE_ENV, "1")
    read = {"esamp_beta": 2.0}
    issued = es.ISSUED.issue(es.Admitted(extra=read, payload=pl.decode(read)))
    try:
        calls = count_decodes(monkeypatch)
        same = SimpleNamespace(
            n=1,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            min_p=0.0,
            seed=None,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            extra_args={**read, "esamp_group": issued.ticket},
        )
        es.prepare(same)
        assert calls["n"] == 0 and same.extra_args["esamp_beta"] == 2.0
        other = SimpleNamespace(
            **{**vars(same), "extra_args": {"esamp_beta": 1.0, "kv_transfer_params": "x", "esamp_group": issued.ticket}}
        )
        es.prepare(other)
        assert calls["n"] == 1 and pl.decode(other.extra_args).steering == {"beta": 1.0}
    finally:
        es.ISSUED.end(issued.ticket)


def test_a_tickets_settings_go_when_its_request_ends(monkeypatch):
    """The settings a ticket holds live as long as its request: while it runs prepare reads them,
    and once it ends (ISSUED.end) nothing of them is left."""
    monkeypatch.setenv(es.SERVE_ENV, "1")

    async def scenario():
        hold = asyncio.Event()
        app = FakeVllm(1, 9, hold)
        running = asyncio.create_task(
            call(EsampMiddleware(app), app, "POST", "/v1/completions", completion(vllm_xargs={"esamp_beta": 1.5}))
        )
        while not app.prepared:
            await asyncio.sleep(0.01)
        ticket = xargs_of(app.seen[-1][1])["esamp_group"]
        held = es.ISSUED.settings(ticket)
        hold.set()
        await running
        return ticket, held

    ticket, held = run(scenario())
    assert held.extra == {"esamp_beta": 1.5} and held.payload.steering == {"beta": 1.5}
    assert es.ISSUED.settings(ticket) is None and ticket not in es.ISSUED and len(es.ISSUED) == 0


def test_naming_a_running_group_gets_the_answer_any_name_gets(monkeypatch):
    """A running group's id tells a client nothing: naming it is refused exactly as naming any other."""
    monkeypatch.setenv(es.SERVE_ENV, "1")

    async def scenario():
        hold = asyncio.Event()
        app = FakeVllm(1, 9, hold)
        middleware = EsampMiddleware(app)
        running = asyncio.create_task(call(middleware, app, "POST", "/v1/completions", completion(n=2), full=True))
        while not app.prepared:
            await asyncio.sleep(0.01)
        live = app.prepared[-1]
        answers = []
        for path in ("/v1/completions", "/v1/responses"):
            for name in (live, "eg-" + "x" * 22):
                answers.append(await call(middleware, app, "POST", path, completion(vllm_xargs={"esamp_group": name})))
        hold.set()
        await running
        return answers

    answers = run(scenario())
    assert {status for status, _ in answers} == {400}
    assert answers[0] == answers[1] and answers[2] == answers[3]


@pytest.mark.parametrize(
    "fields, param, words, absent",
    [
        (dict(n=-1), "n", ["n=-1", "at least 1"], ["esamp_n"]),
        (dict(n=0), "n", ["n=0", "at least 1"], ["esamp_n"]),
        (dict(vllm_xargs={"esamp_mix": "x" * 100_000}), "vllm_xargs", ["esamp_mix='xxx", "… (100000 characters)"], []),
        (
            dict(vllm_xargs={"esamp_" + "y" * 50_000: 1}),
            "vllm_xargs",
            ["unknown ESamp setting", "(50006 characters)"],
            [],
        ),
    ],
)
def test_a_refusal_names_the_field_sent_and_quotes_a_long_value_short(monkeypatch, fields, param, words, absent):
    monkeypatch.setenv(es.SERVE_ENV, "1")
    app = FakeVllm(1, 9)
    status, body = run(call(EsampMiddleware(app), app, "POST", "/v1/completions", completion(**fields)))
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == param and len(body) < 1000, error
    for word in words:
        assert word in error["message"], error["message"]
    for word in absent:
        assert word not in error["message"], error["message"]


def test_several_prompts_are_several_groups_and_records_need_one(monkeypatch):
    monkeypatch.setenv(es.SERVE_ENV, "1")
    app = FakeVllm(1, 9)
    middleware = EsampMiddleware(app)
    status, _, headers = run(call(middleware, app, "POST", "/v1/completions", completion(prompt=["a", "b"]), full=True))
    group = headers[b"x-esamp-group"].decode()
    assert status == 200 and app.engine.calls == [("esamp_release", ([group, group + ".1"],))]
    status, body = run(
        call(
            middleware,
            app,
            "POST",
            "/v1/completions",
            completion(prompt=["a", "b"], vllm_xargs={"esamp_records": "on"}),
        )
    )
    assert status == 400 and json.loads(body)["error"]["param"] == "prompt"


def rank_of(scope) -> str | None:
    return next((v.decode() for k, v in scope["headers"] if k == b"x-data-parallel-rank"), None)


def test_a_group_goes_to_one_rank_and_groups_spread_over_ranks(monkeypatch):
    monkeypatch.setenv(es.SERVE_ENV, "1")

    async def scenario():
        hold = asyncio.Event()
        app = FakeVllm(2, 9, hold)
        middleware = EsampMiddleware(app)
        first = asyncio.create_task(call(middleware, app, "POST", "/v1/completions", completion(n=4)))
        second = asyncio.create_task(call(middleware, app, "POST", "/v1/completions", completion(n=4)))
        chat = asyncio.create_task(
            call(
                middleware,
                app,
                "POST",
                "/v1/chat/completions",
                json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}).encode(),
            )
        )
        own = asyncio.create_task(
            call(middleware, app, "POST", "/v1/completions", completion(n=4), headers=[(b"X-Data-Parallel-Rank", b"1")])
        )
        off = asyncio.create_task(
            call(middleware, app, "POST", "/v1/completions", completion(n=4, vllm_xargs={"esamp": "off"}))
        )
        while len(app.seen) < 5:
            await asyncio.sleep(0.01)
        assert sum(middleware.load.values()) == 4 + 4 + 2 and min(middleware.load.values()) >= 4
        hold.set()
        await asyncio.gather(first, second, chat, own, off)
        return app.seen, middleware

    seen, middleware = run(scenario())
    ranks = [rank_of(scope) for scope, _ in seen]
    assert {ranks[0], ranks[1]} == {"0", "1"}  # two groups in flight: one on each rank
    assert sum(1 for s, _ in seen if any(k.lower() == b"x-data-parallel-rank" for k, _ in s["headers"])) == 4
    assert ranks[4] is None  # ESamp off: vLLM places it
    sent = json.loads(seen[0][1])
    assert {k: v for k, v in sent.items() if k != "vllm_xargs"} == json.loads(completion(n=4))  # as sent ...
    assert list(sent["vllm_xargs"]) == ["esamp_group"]  # ... plus the server's group id
    assert middleware.load == {0: 0, 1: 0}  # all returned


# -- what is refused before vLLM sees it --------------------------------------------------------


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (dict(n="1000"), "n", ["n=1000", "64"]),  # a number as a string: what vLLM will read
        (dict(presence_penalty="0.5"), "presence_penalty", ["penalties"]),
        (dict(n=True), "n", ["n=true", "not true/false"]),
        (dict(temperature=False), "temperature", ["temperature=false"]),
        (dict(seed=True), "seed", ["seed=true"]),
        (dict(vllm_xargs={"esamp_beta": True}), "vllm_xargs", ["esamp_beta=true"]),
        (dict(vllm_xargs={"esamp_beta": "11"}), "vllm_xargs", ["esamp_beta=", "<= 10"]),
        (dict(prompt="caf\udce9"), "prompt", ["prompt: character 4", "surrogate", "\\udce9"]),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_refused_before_any_stream_opens(monkeypatch, fields, param, words, stream):
    monkeypatch.setenv(es.SERVE_ENV, "1")
    app = FakeVllm(1, 9)
    status, body = run(
        call(
            EsampMiddleware(app),
            app,
            "POST",
            "/v1/completions",
            json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": stream, **fields}).encode(),
        )
    )
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
    assert app.seen == []


def test_seed_minus_one_is_no_seed_as_in_vllm(monkeypatch):
    monkeypatch.setenv(es.SERVE_ENV, "1")
    app = FakeVllm(1, 9)
    middleware = EsampMiddleware(app)
    for seed in (-1, -7, 0, 2**40):
        assert run(call(middleware, app, "POST", "/v1/completions", completion(seed=seed, n=2)))[0] == 200, seed


def test_text_a_tokenizer_cannot_read_is_refused_on_tokenize_and_chat(monkeypatch):
    monkeypatch.setenv(es.SERVE_ENV, "1")
    app = FakeVllm(1, 9)
    middleware = EsampMiddleware(app)
    status, body = run(
        call(middleware, app, "POST", "/tokenize", json.dumps({"model": "tiny", "prompt": "a\ud800b"}).encode())
    )
    assert status == 400 and "character 2" in json.loads(body)["error"]["message"]
    status, body = run(
        call(
            middleware,
            app,
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "\udfff"}]}).encode(),
        )
    )
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "messages" and "messages[0].content" in error["message"]
    assert app.seen == []
    assert (
        run(call(middleware, app, "POST", "/tokenize", json.dumps({"prompt": "caf\u00e9 \U0001f600"}).encode()))[0]
        == 200
    )


def test_one_rank_needs_no_pinning_and_refusals_never_reach_vllm(monkeypatch):
    monkeypatch.setenv(es.SERVE_ENV, "1")
    app = FakeVllm(1, 9)
    middleware = EsampMiddleware(app)
    assert run(call(middleware, app, "POST", "/v1/completions", completion(n=4)))[0] == 200
    assert rank_of(app.seen[-1][0]) is None
    status, body = run(
        call(middleware, app, "POST", "/v1/completions", completion(stream=True, repetition_penalty=1.2))
    )
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "repetition_penalty" and error["type"] == "BadRequestError"
    assert len(app.seen) == 1
    for raw in (b"not json", b"[1, 2]", json.dumps({"n": "four"}).encode()):  # vLLM answers these itself
        assert run(call(middleware, app, "POST", "/v1/completions", raw))[0] == 200
        assert app.seen[-1][1] == raw
    assert run(call(middleware, app, "GET", "/v1/models"))[0] == 200  # everything else passes through
    refused = completion(stream=True, repetition_penalty=1.2)  # not sent as JSON: vLLM's own answer (415)
    assert run(call(middleware, app, "POST", "/v1/completions", refused, json_body=False))[0] == 200
    assert app.seen[-1][1] == refused


# -- the server stopping ------------------------------------------------------------------------


def test_when_the_server_stops_every_open_response_ends_with_an_error(monkeypatch):
    monkeypatch.setattr("esamp.serving.middleware.WATCH_INTERVAL", 0.02)
    monkeypatch.setenv(es.SERVE_ENV, "1")

    async def scenario():
        server = SimpleNamespace(should_exit=False, force_exit=False)
        app = FakeVllm(1, 9, hold=asyncio.Event(), server=server)  # vLLM never answers: its engine is gone
        middleware = EsampMiddleware(app)
        stream = asyncio.create_task(
            call(middleware, app, "POST", "/v1/completions", completion(stream=True, n=2), full=True)
        )
        whole = asyncio.create_task(call(middleware, app, "POST", "/v1/completions", completion(n=2)))
        while len(app.seen) < 2:
            await asyncio.sleep(0.01)
        server.should_exit = True  # what vLLM's SIGTERM handler sets once it has stopped its engine
        return await asyncio.wait_for(asyncio.gather(stream, whole), 5), app

    (streamed, whole), app = run(scenario())
    status, body, headers = streamed
    assert status == 200 and headers[b"x-esamp-group"]
    events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
    assert whole[0] == 503 and "send it again" in json.loads(whole[1])["error"]["message"]
    assert len(es.ISSUED) == 0  # the groups are forgotten ...
    assert app.engine.calls == []  # ... and the stopping engine is not asked to free slots that go with it


@pytest.mark.parametrize("drain", [None, "1.6"])
def test_a_stop_signal_ends_open_streams_at_once_and_still_reaches_vllms_handler(monkeypatch, drain):
    """vLLM stops its HTTP server only after draining its engine; the middleware hears SIGTERM itself
    and ends the open stream at once (or, with the operator's --shutdown-timeout, that long less a
    second, while new requests get the 503 at once), and vLLM's own handler still runs."""
    import os
    import signal
    import time

    import uvicorn

    from esamp.serving.middleware import DRAIN_ENV

    monkeypatch.setattr("esamp.serving.middleware.WATCH_INTERVAL", 30.0)  # only the signal can end it in time
    monkeypatch.setenv(es.SERVE_ENV, "1")
    if drain:
        monkeypatch.setenv(DRAIN_ENV, drain)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    async def scenario():
        heard = []
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, heard.append, "vllm")  # as vLLM's serve_http
        server = uvicorn.Server(uvicorn.Config(app=lambda *_: None))
        app = FakeVllm(1, 9, hold=asyncio.Event(), server=server)
        middleware = EsampMiddleware(app)
        stream = asyncio.create_task(call(middleware, app, "POST", "/v1/completions", completion(stream=True, n=2)))
        while not app.seen:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.05)
        late = await asyncio.wait_for(call(middleware, app, "POST", "/v1/completions", completion()), 1)
        late_took = time.monotonic() - t0
        status, body = await asyncio.wait_for(stream, 5)
        took = time.monotonic() - t0
        return status, body, took, late, late_took, heard

    try:
        status, body, took, late, late_took, heard = run(scenario())
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 503 and "shutting down" in events[-2]
    assert late[0] == 503 and late_took < 0.5  # a request after the signal: at once, drain or not
    assert (0.5 <= took < 1.5) if drain else took < 0.5
    assert heard == ["vllm"]


def test_a_dead_engine_ends_open_streams_too(monkeypatch):
    monkeypatch.setattr("esamp.serving.middleware.WATCH_INTERVAL", 0.02)

    async def scenario():
        app = FakeVllm(1, 9, hold=asyncio.Event(), server=SimpleNamespace(should_exit=False))
        middleware = EsampMiddleware(app)
        task = asyncio.create_task(call(middleware, app, "POST", "/v1/completions", completion(stream=True)))
        while not app.seen:
            await asyncio.sleep(0.01)
        app.engine.errored = True
        return await asyncio.wait_for(task, 5)

    status, body = run(scenario())
    assert status == 200 and b"the engine stopped" in body and body.endswith(b"data: [DONE]\n\n")


def test_other_generating_routes_get_server_groups_too(monkeypatch):
    """``/v1/responses``, ``/v1/messages``, ``/v1/chat/completions/batch``: vLLM checks their bodies,
    but each request still gets its group id (one group per conversation of a batch), a named
    group is refused, and the slots are freed when the request ends."""
    monkeypatch.setenv(es.SERVE_ENV, "1")
    app = FakeVllm(1, 9)
    middleware = EsampMiddleware(app)
    status, _, headers = run(
        call(middleware, app, "POST", "/v1/responses", json.dumps({"model": "tiny", "input": "hi"}).encode(), full=True)
    )
    group = headers[b"x-esamp-group"].decode()
    assert status == 200 and list(xargs_of(app.seen[-1][1])) == ["esamp_group"] and app.prepared == [group]
    status, _, headers = run(
        call(
            middleware,
            app,
            "POST",
            "/v1/chat/completions/batch",
            json.dumps(
                {"model": "tiny", "messages": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]}
            ).encode(),
            full=True,
        )
    )
    assert status == 200 and headers[b"x-esamp-group"]
    for path in ("/v1/responses", "/v1/messages", "/v1/chat/completions/batch"):
        status, body = run(
            call(
                middleware,
                app,
                "POST",
                path,
                json.dumps({"model": "tiny", "input": "hi", "vllm_xargs": {"esamp_group": group}}).encode(),
            )
        )
        assert status == 400 and "set by the server" in json.loads(body)["error"]["message"], path
    status, _, headers = run(
        call(
            middleware,
            app,
            "POST",
            "/v1/messages",
            json.dumps({"model": "tiny", "messages": [], "vllm_xargs": {"esamp": "off"}}).encode(),
            full=True,
        )
    )
    assert status == 200 and b"x-esamp-group" not in headers
    assert len(es.ISSUED) == 0
