"""The API server's ESamp middleware, as ASGI, against a stand-in for vLLM's app and two ranks' real
side channels (``esamp.engines.vllm.channel.Channel`` over stand-in processors). No vLLM needed."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from esamp.core.config import EsampConfig
from esamp.engines.vllm.channel import Channel
from esamp.serving.command import free_ports
from esamp.serving.middleware import EsampMiddleware
from esamp.serving.metrics import parse


class FakeProcessor:
    """What a channel reads from the logits processor: counters, and records taken per group."""

    def __init__(self, rank: int, groups: dict[str, int]) -> None:
        self.rank = rank
        self.records = [{"step": 1, "time": 0.0, "rows": [[g, 0, 0, 0.5, 9] for g in groups], "loss": dict(groups)}]

    def metrics(self) -> dict:
        return {"port_hits": 10 * (self.rank + 1), "steps": 3, "slots_in_use": 1, "slots_free": 7, "loss": 0.25}

    def drain(self, release, groups):
        mine = [{**r, "rows": [x for x in r["rows"] if groups is None or x[0] in groups]} for r in self.records]
        self.records = [{**r, "rows": [x for x in r["rows"] if groups is not None and x[0] not in groups]}
                        for r in self.records]
        return {"steps": [r for r in mine if r["rows"]], "pending": 0}


class FakeVllm:
    """vLLM's app as the middleware sees it: answers 200 and remembers what reached it."""

    def __init__(self, ranks: int, port: int | None, hold: asyncio.Event | None = None) -> None:
        server = {"records_requested": True, "host": "127.0.0.1", "port": port} if port else None
        self.state = SimpleNamespace(vllm_config=SimpleNamespace(
            additional_config={"esamp": EsampConfig(slots=8).model_dump(), **({"esamp_server": server} if server else {})},
            parallel_config=SimpleNamespace(data_parallel_size=ranks),
            model_config=SimpleNamespace(hf_config=SimpleNamespace(hidden_size=16, num_hidden_layers=2),
                                         served_model_name=["tiny"], model="/models/tiny", max_model_len=256)))
        self.seen: list[tuple[dict, bytes]] = []
        self.hold = hold

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append((dict(scope), body))
        if self.hold is not None:
            await self.hold.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def call(middleware, app, method, path, body=b"", headers=(), query=b"", json_body=True):
    headers = [*headers, *([(b"content-type", b"application/json")] if json_body else [])]
    scope = {"type": "http", "method": method, "path": path, "query_string": query, "headers": headers,
             "app": app}
    chunks = [body[i:i + 7] for i in range(0, len(body), 7)] or [b""]  # a body in several messages
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await middleware(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def ranks():
    port = free_ports(2)
    channels = [Channel(FakeProcessor(r, {f"g{r}": 0.1 * (r + 1)}), "127.0.0.1", port + r, r) for r in range(2)]
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
    assert text.count("# TYPE esamp_rows_steered_total counter") == 1  # one header per family
    assert families["esamp_rows_steered_total"]["samples"] == [('{rank="0"}', "10"), ('{rank="1"}', "20")]
    assert families["esamp_bank_full_total"]["samples"] == [('{rank="0"}', "0"), ('{rank="1"}', "0")]
    assert families["esamp_channel_up"]["samples"] == [('{rank="0"}', "1"), ('{rank="1"}', "1")]
    channels[1].close()  # a rank that does not answer is marked down; the others still show
    status, body = run(call(middleware, app, "GET", "/esamp/metrics"))
    families = parse(body.decode())
    assert families["esamp_channel_up"]["samples"] == [('{rank="0"}', "1"), ('{rank="1"}', "0")]
    assert families["esamp_rows_steered_total"]["samples"] == [('{rank="0"}', "10")]
    prometheus = pytest.importorskip("prometheus_client.parser")
    names = {f.name for f in prometheus.text_string_to_metric_families(body.decode())}
    assert {"esamp_rows_steered", "esamp_channel_up", "esamp_distiller_loss"} <= names


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


def completion(**fields) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields}).encode()


def rank_of(scope) -> str | None:
    return next((v.decode() for k, v in scope["headers"] if k == b"x-data-parallel-rank"), None)


def test_a_group_goes_to_one_rank_and_groups_spread_over_ranks(monkeypatch):
    monkeypatch.setenv("ESAMP_SERVE", "1")

    async def scenario():
        hold = asyncio.Event()
        app = FakeVllm(2, 9, hold)
        middleware = EsampMiddleware(app)
        first = asyncio.create_task(call(middleware, app, "POST", "/v1/completions", completion(n=4)))
        second = asyncio.create_task(call(middleware, app, "POST", "/v1/completions", completion(n=4)))
        same = asyncio.create_task(call(middleware, app, "POST", "/v1/chat/completions",
                                        completion(n=2, vllm_xargs={"esamp_group": "mine"})))
        again = asyncio.create_task(call(middleware, app, "POST", "/v1/chat/completions",
                                         completion(vllm_xargs={"esamp_group": "mine"})))
        own = asyncio.create_task(call(middleware, app, "POST", "/v1/completions", completion(n=4),
                                       headers=[(b"X-Data-Parallel-Rank", b"1")]))
        off = asyncio.create_task(call(middleware, app, "POST", "/v1/completions",
                                       completion(n=4, vllm_xargs={"esamp": "off"})))
        while len(app.seen) < 6:
            await asyncio.sleep(0.01)
        assert sum(middleware.load.values()) == 4 + 4 + 2 + 1 and min(middleware.load.values()) >= 4
        hold.set()
        await asyncio.gather(first, second, same, again, own, off)
        return app.seen, middleware

    seen, middleware = run(scenario())
    ranks = [rank_of(scope) for scope, _ in seen]
    assert {ranks[0], ranks[1]} == {"0", "1"}  # two groups in flight: one on each rank
    assert ranks[2] == ranks[3]  # the same esamp_group: the same rank
    assert sum(1 for s, _ in seen if any(k.lower() == b"x-data-parallel-rank" for k, _ in s["headers"])) == 5
    assert ranks[5] is None  # ESamp off: vLLM places it
    assert seen[0][1] == completion(n=4)  # vLLM gets the body as sent
    assert middleware.load == {0: 0, 1: 0} and middleware.groups == {}  # all returned


def test_one_rank_needs_no_pinning_and_refusals_never_reach_vllm(monkeypatch):
    monkeypatch.setenv("ESAMP_SERVE", "1")
    app = FakeVllm(1, 9)
    middleware = EsampMiddleware(app)
    assert run(call(middleware, app, "POST", "/v1/completions", completion(n=4)))[0] == 200
    assert rank_of(app.seen[-1][0]) is None
    status, body = run(call(middleware, app, "POST", "/v1/completions", completion(stream=True, repetition_penalty=1.2)))
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
