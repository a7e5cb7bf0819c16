"""``EsampMiddleware``: what ESamp adds to vLLM's OpenAI server, as one ASGI middleware.

vLLM loads it with ``--middleware esamp.serving.middleware.EsampMiddleware`` (``esamp serve`` adds
that). It reads the server's settings from vLLM's own configuration (``app.state.vllm_config``:
``additional_config["esamp"]`` and ``["esamp_server"]``, the data-parallel size), so it needs no
settings of its own. It does three things:

1. **Refuses what ESamp cannot serve with a 400** before vLLM answers: ``POST /v1/completions``
   and ``/v1/chat/completions`` bodies go through ``esamp.serving.admission`` (the engine's own
   check), so a streaming request is refused as a bad request too, not with an error event inside
   a 200 stream.
2. **Keeps a group on one rank.** vLLM fans a request with n > 1 out into n child requests, and
   with ``--data-parallel-size N`` its load balancer places each child on its own (children of one
   request land on different ranks, each with its own Distiller bank). An ESamp group is one
   Distiller slot, so the middleware pins the whole request to one rank with vLLM's
   ``X-data-parallel-rank`` header: the rank with the fewest samples in flight through this API
   server (several API server processes each balance their own requests). Requests that name the
   same ``esamp_group`` while one of them runs share a rank. A request that already carries the
   header keeps it.
3. **Serves every rank's side channel:** ``GET /esamp/metrics`` (Prometheus text, samples
   labelled ``rank``), ``GET /esamp/records?group=G[,G...]`` (the groups' novelty records from
   every rank, taken: a record is handed out once) and ``GET /esamp/config`` (the server's ESamp
   settings, ranks and channel ports). Like vLLM's own ``/metrics`` they are outside ``/v1``, so
   ``--api-key`` does not guard them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from dataclasses import asdict, dataclass
from urllib.parse import parse_qs, quote

from esamp.serving.admission import Refused, admit
from esamp.serving.metrics import merge

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
RANK_HEADER = b"x-data-parallel-rank"  # vLLM reads it as X-data-parallel-rank
CHANNEL_TIMEOUT = 5.0  # seconds to wait for a rank's channel (it answers from a thread of the engine core)
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class ServerInfo:
    """The served deployment, as vLLM's configuration describes it (``GET /esamp/config``)."""

    esamp: dict  # EsampConfig: the engine-wide settings and the default steering
    channel_host: str
    channel_port: int  # rank r's side channel is on channel_port + r
    ranks: int  # data-parallel ranks (engine cores), each with its own Distiller bank
    model: str  # the served model name
    hidden_size: int
    num_layers: int
    max_model_len: int
    records_requested: bool  # records are kept only for requests that ask (esamp_records: on)

    def channels(self) -> list[tuple[int, str, int]]:
        return [(rank, self.channel_host, self.channel_port + rank) for rank in range(self.ranks)]


def server_info(vllm_config) -> ServerInfo | None:
    """This server's ``ServerInfo``, or None when it runs without ESamp's side channel."""
    from esamp.engines.vllm.settings import SERVER_KEY, engine_config

    extra = getattr(vllm_config, "additional_config", None) or {}
    server = extra.get(SERVER_KEY) if isinstance(extra, dict) else None
    if isinstance(server, str):
        server = json.loads(server)
    esamp = engine_config(vllm_config)
    if not server or not server.get("port") or esamp is None:
        return None
    model_config = vllm_config.model_config
    hf = model_config.hf_config
    names = getattr(model_config, "served_model_name", None) or model_config.model
    return ServerInfo(
        esamp=esamp.model_dump(), channel_host=server.get("host", "127.0.0.1"), channel_port=int(server["port"]),
        ranks=int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1),
        model=names[0] if isinstance(names, (list, tuple)) else str(names),
        hidden_size=int(getattr(hf, "hidden_size", 0) or 0), num_layers=int(getattr(hf, "num_hidden_layers", 0) or 0),
        max_model_len=int(getattr(model_config, "max_model_len", 0) or 0),
        records_requested=bool(server.get("records_requested", False)))


async def fetch(host: str, port: int, path: str, timeout: float = CHANNEL_TIMEOUT) -> tuple[int, bytes]:
    """``GET path`` from a side channel (HTTP/1.0: the channel closes the connection after it)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)
    return (int(status[1]) if len(status) > 1 and status[1].isdigit() else 502), body


class EsampMiddleware:
    def __init__(self, app) -> None:
        self.app = app
        self.info: ServerInfo | None = None
        self._looked = False
        self.load: dict[int, int] = {}  # rank → samples in flight pinned there by this API server
        self.groups: dict[str, list[int]] = {}  # client group → [rank, requests in flight]
        # Where ties between equally loaded ranks start. vLLM may run several API server processes
        # (with --data-parallel-size, vllm serve starts one per rank), each with a middleware of
        # its own: starting at random keeps them from all sending their first group to rank 0.
        self._turn = itertools.count(random.randrange(1 << 16))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path == "/esamp" or path.startswith("/esamp/"):
                await self._route(scope, send)
                return
            if scope["method"] == "POST" and path in GENERATE_PATHS and _is_json(scope):
                await self._generate(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _server(self, scope) -> ServerInfo | None:
        """Read from vLLM's configuration once it is there (it is set before the server listens)."""
        if not self._looked:
            state = getattr(scope.get("app"), "state", None)
            config = getattr(state, "vllm_config", None) if state is not None else None
            if config is not None:
                self.info, self._looked = server_info(config), True
        return self.info

    # -- generation requests ---------------------------------------------------------------------

    async def _generate(self, scope, receive, send) -> None:
        body = await _read_body(receive)
        if body is None:
            return  # the client left before sending its request
        replay = _replay(body, receive)
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict):
            await self.app(scope, replay, send)  # not a JSON object: vLLM answers it
            return
        try:
            admission = admit(request)
        except Refused as refused:
            await _respond(send, 400, json.dumps(refused.body()), "application/json")
            return
        info = self._server(scope)
        rank = None
        if admission.steered and info is not None and info.ranks > 1 \
                and not any(key.lower() == RANK_HEADER for key, _ in scope["headers"]):
            rank = self._pin(admission, info.ranks)
            scope = dict(scope, headers=[*scope["headers"], (RANK_HEADER, str(rank).encode())])
        try:
            await self.app(scope, replay, send)
        finally:
            if rank is not None:
                self._unpin(rank, admission)

    def _pin(self, admission, ranks: int) -> int:
        held = self.groups.get(admission.group) if admission.group is not None else None
        if held is not None:
            rank = held[0]
            held[1] += 1
        else:
            start = next(self._turn)
            rank = min(((start + i) % ranks for i in range(ranks)), key=lambda r: self.load.get(r, 0))
            if admission.group is not None:
                self.groups[admission.group] = [rank, 1]
        self.load[rank] = self.load.get(rank, 0) + admission.n
        return rank

    def _unpin(self, rank: int, admission) -> None:
        self.load[rank] -= admission.n
        held = self.groups.get(admission.group) if admission.group is not None else None
        if held is not None:
            held[1] -= 1
            if held[1] <= 0:
                del self.groups[admission.group]

    # -- /esamp/... ------------------------------------------------------------------------------

    async def _route(self, scope, send) -> None:
        path = scope["path"]
        routes = {"/esamp/metrics": self._metrics, "/esamp/records": self._records, "/esamp/config": self._config}
        handler = routes.get(path)
        if handler is None:
            await _respond(send, 404, json.dumps({"error": {
                "message": f"no such ESamp route {path}", "type": "NotFoundError", "param": None, "code": 404,
                "routes": ["/esamp/metrics", "/esamp/records?group=G", "/esamp/config"]}}), "application/json")
            return
        if scope["method"] not in ("GET", "HEAD"):
            await _respond(send, 405, json.dumps(_error(405, f"{path} answers GET only")), "application/json")
            return
        info = self._server(scope)
        if info is None:
            await _respond(send, 503, json.dumps(_error(503, "this server has no ESamp side channel (or has not "
                                                         "finished starting): start it with esamp serve")),
                           "application/json")
            return
        await handler(scope, send, info)

    async def _config(self, scope, send, info: ServerInfo) -> None:
        out = asdict(info)
        out["channels"] = [f"http://{host}:{port}" for _, host, port in info.channels()]
        await _respond(send, 200, json.dumps(out), "application/json")

    async def _gather(self, info: ServerInfo, path: str) -> dict[int, tuple[int, bytes] | Exception]:
        async def one(host: str, port: int):
            try:
                return await fetch(host, port, path)
            except (OSError, asyncio.TimeoutError, ValueError) as exc:
                return exc

        got = await asyncio.gather(*(one(host, port) for _, host, port in info.channels()))
        return {rank: result for (rank, _, _), result in zip(info.channels(), got)}

    async def _metrics(self, scope, send, info: ServerInfo) -> None:
        got = await self._gather(info, "/metrics")
        texts = {rank: r[1].decode() if isinstance(r, tuple) and r[0] == 200 else None for rank, r in got.items()}
        await _respond(send, 200, merge(texts), PROMETHEUS)

    async def _records(self, scope, send, info: ServerInfo) -> None:
        query = parse_qs(scope.get("query_string", b"").decode())
        groups = sorted({g for value in query.get("group", []) for g in value.split(",") if g})
        if not groups:
            await _respond(send, 400, json.dumps(_error(400, "name the groups whose records you take: "
                                                             "/esamp/records?group=G[,G...]", "group")),
                           "application/json")
            return
        got = await self._gather(info, "/records?group=" + quote(",".join(groups), safe=","))
        steps, pending, unreachable = [], 0, []
        for rank, result in sorted(got.items()):
            try:
                if isinstance(result, Exception) or result[0] != 200:
                    raise ValueError(result)
                data = json.loads(result[1])
            except (ValueError, TypeError):
                unreachable.append(rank)
                continue
            pending += int(data.get("pending", 0))
            steps += [{**step, "rank": rank} for step in data.get("steps", [])]
        await _respond(send, 200, json.dumps({"steps": steps, "pending": pending, "unreachable": unreachable}),
                       "application/json")


# -- ASGI plumbing -------------------------------------------------------------------------------


async def _read_body(receive) -> bytes | None:
    """The whole request body (None if the client disconnected first)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """A ``receive`` that hands vLLM the body read already, then the client's own messages
    (vLLM listens for the disconnect to abort a request)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _is_json(scope) -> bool:
    """A JSON body (anything else vLLM refuses itself, with its own status)."""
    kind = next((v for k, v in scope["headers"] if k.lower() == b"content-type"), b"")
    return b"json" in kind.lower()


def _error(code: int, message: str, param: str | None = None) -> dict:
    kind = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 503: "ServiceUnavailable"}
    return {"error": {"message": message, "type": kind.get(code, "Error"), "param": param, "code": code}}


async def _respond(send, status: int, body: str, content_type: str) -> None:
    data = body.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
