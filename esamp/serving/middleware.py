"""``EsampMiddleware``: what ESamp adds to vLLM's OpenAI server, as one ASGI middleware.

vLLM loads it with ``--middleware esamp.serving.middleware.EsampMiddleware`` (``esamp serve`` adds
that); it is the outermost layer, so every request meets it first. It reads the server's settings
from vLLM's own configuration (``app.state.vllm_config``: ``additional_config["esamp"]`` and
``["esamp_server"]``, the data-parallel size; ``app.state.args``: ``--api-key``), so it needs no
settings of its own. What it does (docs/serving.md says it for users):

1. **Guards every route with the API key** (``--api-key``; ``esamp serve`` passes it in the
   environment, ``KEYS_ENV``, never on a command line) except ``OPEN``: the health checks and the
   two Prometheus texts. vLLM's own check covers only the paths under ``/v1`` (and a few
   prefixes); ``/invocations``, ``/tokenize``, ``/docs``, ``/esamp/records`` ... would answer
   anyone. Denied by default: a route vLLM adds later is guarded too.
2. **Refuses what ESamp cannot serve with a 400** before vLLM answers: completion and chat bodies
   (``/v1/completions``, ``/v1/chat/completions``, ``/invocations``) go through
   ``esamp.serving.admission`` (the engine's own check, on the body as vLLM reads it), so a
   streaming request is refused as a bad request too, not with an error event inside a 200 stream.
3. **Owns group identity.** Each request on a route that generates with ``vllm_xargs``
   (``esamp.serving.routes``: the ``STEERED`` ones) gets a group from the server
   (``settings.ISSUED``): its unguessable id goes back in the ``X-Esamp-Group`` response header,
   and a private ticket for it into the request's ``vllm_xargs``; a request naming a group itself
   is refused, whichever group it names. Its records are read with that id. When the request ends
   (finished, failed or the client gone), its groups' Distiller slots are freed on every rank at
   once (``esamp_release`` through vLLM's ``collective_rpc``, which runs between engine steps): an
   idle server holds no slot. A request on any other route holds none (the engine steers only the
   groups issued here); which routes the running server has is read from vLLM's app.
4. **Keeps a group on one rank.** vLLM fans a request with n > 1 out into n child requests, and
   with ``--data-parallel-size N`` its load balancer places each child on its own (children of one
   request land on different ranks, each with its own Distiller bank). An ESamp group is one
   Distiller slot, so the middleware pins the whole request to one rank with vLLM's
   ``X-data-parallel-rank`` header: the rank with the fewest samples in flight through this API
   server (several API server processes each balance their own requests). A request that already
   carries the header keeps it.
5. **Ends every open response when the server stops.** On SIGTERM or SIGINT vLLM first drains
   its engine (``--shutdown-timeout`` seconds) and only then stops the HTTP server, so open
   streams would wait for the engine and end with its death (vLLM's 500). The middleware hears the
   signal itself, the moment it comes (its handler runs before vLLM's and then calls it), and so
   also when the server is stopping otherwise (``server.should_exit``) or the engine has died:
   every response still open gets the 503 "the server is shutting down" (a 503 before its
   headers, an error event and ``[DONE]`` inside a stream) and ends, and vLLM aborts the requests,
   so the engine stops with nothing in flight. With the operator's ``--shutdown-timeout``
   (``DRAIN_ENV``) running requests may first go on that long, less ``DRAIN_MARGIN``.
6. **Serves every rank's side channel:** ``GET /esamp/metrics`` (Prometheus text, samples
   labelled ``rank``), ``GET /esamp/records?group=G[,G...]`` (the groups' novelty records from
   every rank, taken: a record is handed out once) and ``GET /esamp/config`` (the server's ESamp
   settings and ranks). The channels answer only with the per-launch secret.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import logging
import os
import random
import signal
import sys
import threading
from dataclasses import asdict, dataclass
from urllib.parse import parse_qs, quote

from esamp.core import payload as pl
from esamp.engines.vllm.settings import ISSUED, SERVE_ENV
from esamp.errors import shown
from esamp.platform.http_client import request
from esamp.serving import routes as rt
from esamp.serving.admission import Refused, admit, many_prompts_with_records, refuse_surrogates
from esamp.serving.channel import CHANNEL_SECRET_ENV, HOST, SECRET_HEADER, read_groups
from esamp.serving.metrics import merge

ROUTES = ("/esamp/metrics", "/esamp/records?group=ID", "/esamp/config")  # what this middleware serves

log = logging.getLogger(__name__)

ADMITTED = {rt.COMPLETION: False, rt.CHAT: True, rt.EITHER: None}  # a route's check → admit's ``chat``
# Answer without the API key: load balancers' health checks and Prometheus scrapes. Neither
# generates text nor shows a tenant's data (counters only). Everything else needs the key.
OPEN = frozenset({"/health", "/ping", "/metrics", "/esamp/metrics"})
GROUP_HEADER = b"x-esamp-group"  # the request's group id, in the response (read records with it)
RANK_HEADER = b"x-data-parallel-rank"  # vLLM reads it as X-data-parallel-rank
CHANNEL_TIMEOUT = 5.0  # seconds to wait for a rank's channel (it answers from a thread of the engine core)
WATCH_INTERVAL = 0.2  # seconds between looks at whether the server is stopping
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own fallback for --api-key (one key)
KEYS_ENV = "ESAMP_SERVE_API_KEYS"  # the keys esamp serve was given, as a JSON list (never on a command line)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what vLLM's server stops on
# Seconds a running request may take to finish after a stop signal: the --shutdown-timeout the
# operator gave esamp serve (its own default gives the engine time to stop, not the requests: 0 here).
DRAIN_ENV = "ESAMP_SERVE_DRAIN"
DRAIN_MARGIN = 1.0  # a drained request ends this long before vLLM's deadline, while its engine still runs
SHUTTING_DOWN = "the server is shutting down; this request did not finish: send it again (to a running server)"
ENGINE_STOPPED = "the engine stopped; this request did not finish: send it again once the server is back"


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
    from esamp.engines.vllm.settings import engine_config, server_settings

    server = server_settings(vllm_config)
    esamp = engine_config(vllm_config)
    if not server or not server.get("port") or esamp is None:
        return None
    model_config = vllm_config.model_config
    hf = model_config.hf_config
    names = getattr(model_config, "served_model_name", None) or model_config.model
    return ServerInfo(
        esamp=esamp.flat(),
        channel_host=server.get("host", HOST),
        channel_port=int(server["port"]),
        ranks=int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1),
        model=names[0] if isinstance(names, (list, tuple)) else str(names),
        hidden_size=int(getattr(hf, "hidden_size", 0) or 0),
        num_layers=int(getattr(hf, "num_hidden_layers", 0) or 0),
        max_model_len=int(getattr(model_config, "max_model_len", 0) or 0),
        records_requested=bool(server.get("records_requested", False)),
    )


async def fetch(host: str, port: int, path: str, secret: str, timeout: float = CHANNEL_TIMEOUT) -> tuple[int, bytes]:
    """``GET path`` from a side channel, with the per-launch secret."""
    return await request(host, port, path, headers={SECRET_HEADER: secret}, timeout=timeout)


def api_keys(app) -> list[bytes]:
    """SHA-256 digests of the keys this server takes, empty when it takes none: ``--api-key`` on
    vLLM's command line (a ``vllm serve`` line of your own), else ``KEYS_ENV`` (where ``esamp serve``
    puts them), else ``VLLM_API_KEY`` (vLLM's own fallback), as vLLM gives the command line
    precedence."""
    args = getattr(getattr(app, "state", None), "args", None)
    given = getattr(args, "api_key", None)
    if isinstance(given, str):
        given = [given]
    keys = [k for k in (given or env_keys()) if k]
    return [hashlib.sha256(k.encode()).digest() for k in keys]


def env_keys() -> list[str]:
    """The keys in the environment: ``KEYS_ENV``'s list, else ``VLLM_API_KEY``. A ``KEYS_ENV`` that is
    not a JSON list of strings is taken whole as one key: the server stays closed, never open."""
    raw = os.environ.get(KEYS_ENV)
    if not raw:  # unset (or set to nothing): vLLM's variable
        return [os.environ.get(API_KEY_ENV) or ""]
    try:
        keys = json.loads(raw)
    except ValueError:
        keys = None
    if not (isinstance(keys, list) and keys and all(isinstance(k, str) and k for k in keys)):
        log.error("ESamp: %s is not a JSON list of keys; taking it whole as the one key", KEYS_ENV)
        return [raw]
    return keys


def drain_seconds() -> float:
    """``DRAIN_ENV``'s seconds (0 when unset or not a number: end at once)."""
    try:
        return max(0.0, float(os.environ.get(DRAIN_ENV) or 0))
    except ValueError:
        return 0.0


def authorised(scope, keys: list[bytes]) -> bool:
    header = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
    scheme, _, token = header.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.strip().encode()).digest()
    return any(hmac.compare_digest(digest, key) for key in keys)  # every key compared: no timing tell


def is_open(path: str) -> bool:
    return path in OPEN or path.startswith("/metrics/")


class _Response:
    """A request's ``send``, watched: whether its response has started, is a stream, has ended;
    adds response headers; and, once the server stops, ends it with an error instead."""

    def __init__(self, send, headers: list[tuple[bytes, bytes]] = ()) -> None:
        self._send = send
        self.headers = list(headers)
        self.started = self.streaming = self.ended = self.cut = False

    async def send(self, message) -> None:
        if self.cut:
            return  # the server is stopping: this response was ended already
        kind = message["type"]
        if kind == "http.response.start":
            self.started = True
            headers = list(message.get("headers", ())) + self.headers
            self.streaming = any(k.lower() == b"content-type" and b"event-stream" in v.lower() for k, v in headers)
            message = {**message, "headers": headers}
        elif kind == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self._send(message)

    async def end_with(self, status: int, message: str) -> None:
        """End the response with an error: a whole error response if none started, else an error
        event and ``[DONE]`` inside a stream, else the end of the body."""
        if self.ended or self.cut:
            return
        self.cut = True
        error = _error(status, message)
        try:
            if not self.started:
                data = json.dumps(error).encode()
                await self._send(
                    {
                        "type": "http.response.start",
                        "status": status,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close"),
                            *self.headers,
                        ],
                    }
                )
                await self._send({"type": "http.response.body", "body": data})
            elif self.streaming:
                await self._send(
                    {
                        "type": "http.response.body",
                        "more_body": False,
                        "body": b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n",
                    }
                )
            else:
                await self._send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:  # the client left already
            pass


class EsampMiddleware:
    def __init__(self, app) -> None:
        self.app = app
        self.info: ServerInfo | None = None
        self._looked = False
        self.keys: list[bytes] | None = None  # the API keys' digests, read from vLLM's arguments once
        self.load: dict[int, int] = {}  # rank → samples in flight pinned there by this API server
        # Where ties between equally loaded ranks start. vLLM may run several API server processes
        # (with --data-parallel-size, vllm serve starts one per rank), each with a middleware of
        # its own: starting at random keeps them from all sending their first group to rank 0.
        self._turn = itertools.count(random.randrange(1 << 16))
        self.secret = os.environ.get(CHANNEL_SECRET_ENV, "")
        self._stopping: asyncio.Future | None = None  # its result: why the server stops
        self._watcher: asyncio.Task | None = None
        self._hearing = False  # our handler for the stop signals is in place (once per process)
        self._drain_until = float("inf")  # (loop time) when open responses end once the server stops
        self._releasing: list[str] = []  # groups whose slots are to be freed
        self._release_task: asyncio.Task | None = None
        self.routes: dict[str, list[str]] | None = None  # the server's POST routes by kind (routes.classify)
        self._unanswered: dict[int, str] = {}  # rank → why its side channel did not answer (logged once)

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan
            return
        path = scope["path"].removeprefix(scope.get("root_path", "") or "")
        if scope.get("method") != "OPTIONS" and not is_open(path):  # OPTIONS: CORS preflights, as vLLM
            keys = self.keys
            if keys is None:
                keys = api_keys(scope.get("app"))
                if scope.get("app") is not None:
                    self.keys = keys  # vLLM's arguments are there from the first request on
            if keys and not authorised(scope, keys):
                await _unauthorised(kind, receive, send)
                return
        if kind == "websocket":
            await self.app(scope, receive, send)
            return
        if self.routes is None:
            self._read_routes(scope.get("app"))
        if path == "/esamp" or path.startswith("/esamp/"):
            await self._route(scope, path, send)
            return
        route = rt.POST_ROUTES.get(path)
        if scope["method"] == "POST" and route is not None and route.check and _is_json(scope):
            await self._inspect(scope, route, receive, send)
            return
        await self._run(scope, receive, _Response(send))

    def _server(self, scope) -> ServerInfo | None:
        """Read from vLLM's configuration once it is there (it is set before the server listens)."""
        if not self._looked:
            state = getattr(scope.get("app"), "state", None)
            config = getattr(state, "vllm_config", None) if state is not None else None
            if config is not None:
                self.info, self._looked = server_info(config), True
        return self.info

    def _read_routes(self, app) -> None:
        """The POST routes vLLM's app serves, by kind (``routes.classify``), read once; a route esamp
        does not know is logged: its requests are sampled without ESamp."""
        if app is None or not hasattr(app, "routes"):
            return
        self.routes = rt.classify(rt.posts(app))
        for path in self.routes[rt.UNKNOWN]:
            log.warning(
                "ESamp: this vLLM serves POST %s, a route esamp does not know: its requests are sampled "
                "without ESamp and hold no Distiller slot "
                '(docs/serving.md, "Routes: which generate, and how each is served")',
                path,
            )

    # -- every request vLLM answers: ended when the server stops -----------------------------------

    async def _run(self, scope, receive, response: _Response) -> None:
        stopping = self._watch(scope.get("app"))
        before = not stopping.done()  # a request that came before the stop may drain; a later one may not
        task = asyncio.ensure_future(self.app(scope, receive, response.send))
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
            left = self._drain_until - asyncio.get_running_loop().time()
            if not task.done() and before and left > 0:
                await asyncio.wait({task}, timeout=left)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.done():
            task.result()  # vLLM's own failure, raised as it would be without us
            return
        task.cancel()
        try:
            await task
        except BaseException:  # cancelled, or what vLLM raised while stopping
            pass
        await response.end_with(503, stopping.result())

    def _watch(self, app) -> asyncio.Future:
        """A future that completes (with the reason) once the server is stopping (never, for an app
        that is not vLLM's server: it has no ``state.server``)."""
        loop = asyncio.get_running_loop()
        if self._stopping is None or self._stopping.get_loop() is not loop:
            self._stopping = loop.create_future()
            state = getattr(app, "state", None)
            if getattr(state, "server", None) is not None or getattr(state, "engine_client", None) is not None:
                self._watcher = loop.create_task(self._watch_server(state, self._stopping))
                self._hear_signals(loop, getattr(state, "server", None))
        return self._stopping

    def _stop(self, reason: str, drain: float = 0.0) -> None:
        """The server is stopping: new requests get a 503 at once; open ones after ``drain`` seconds
        (less ``DRAIN_MARGIN``), at once by default."""
        if self._stopping is not None and not self._stopping.done():
            self._drain_until = self._stopping.get_loop().time() + max(0.0, drain - DRAIN_MARGIN)
            log.warning(
                "ESamp: %s: ending every open response with an error%s",
                reason.partition(";")[0],
                f" after {drain - DRAIN_MARGIN:.0f} s" if drain > DRAIN_MARGIN else "",
            )
            self._stopping.set_result(reason)

    async def _watch_server(self, state, stopping: asyncio.Future) -> None:
        """Stop when vLLM's server is stopping for a reason of its own, or its engine has died."""
        while not stopping.done():
            await asyncio.sleep(WATCH_INTERVAL)
            server = getattr(state, "server", None)
            engine = getattr(state, "engine_client", None)
            if server is not None and (getattr(server, "should_exit", False) or getattr(server, "force_exit", False)):
                self._stop(SHUTTING_DOWN)
            elif engine is not None and getattr(engine, "errored", False):
                self._stop(ENGINE_STOPPED)

    def _hear_signals(self, loop, server) -> None:
        """Hear SIGTERM and SIGINT when they come, in vLLM's server process. vLLM's own handler (on its
        event loop) drains the engine for ``--shutdown-timeout`` seconds before it stops the HTTP
        server, which is what would keep open streams waiting; ours runs first, ends them, and then
        calls vLLM's. Only in the main thread of a process that runs uvicorn's server (vLLM's), and
        only over a handler that is a Python function (vLLM's event loop's): a default or ignored
        signal is left as it is."""
        uvicorn = sys.modules.get("uvicorn")
        if uvicorn is None or not isinstance(server, uvicorn.Server) or self._hearing:
            return
        if threading.current_thread() is not threading.main_thread():
            return
        self._hearing = True
        for sig in STOP_SIGNALS:
            previous = signal.getsignal(sig)
            if not callable(previous):
                continue

            def handler(signum, frame, previous=previous):
                loop.call_soon_threadsafe(self._stop, SHUTTING_DOWN, drain_seconds())
                previous(signum, frame)

            signal.signal(sig, handler)

    # -- generation requests ---------------------------------------------------------------------

    async def _inspect(self, scope, route: rt.Route, receive, send) -> None:
        body = await _read_body(receive)
        if body is None:
            return  # the client left before sending its request
        try:
            request = json.loads(body)
        except ValueError:
            request = None
        if not isinstance(request, dict):
            await self._run(scope, _replay(body, receive), _Response(send))  # not a JSON object: vLLM answers it
            return
        try:
            if route.check == rt.TEXT:
                refuse_surrogates(request)
                await self._run(scope, _replay(body, receive), _Response(send))
                return
            admission = (
                admit(request, ADMITTED[route.check])
                if route.check in ADMITTED
                else other_admission(request, route.prompts)
            )
        except Refused as refused:
            await _respond(send, 400, json.dumps(refused.body()), "application/json")
            return
        except Exception:  # our check failed, not the request: vLLM answers it as it would without us
            log.exception("ESamp's request check failed; the request goes to vLLM unchecked")
            await self._run(scope, _replay(body, receive), _Response(send))
            return
        info = self._server(scope)
        issued, headers, rank = None, [], None
        if admission.steered:
            issued = ISSUED.issue(admission.settings)  # prepare takes the settings admission checked
            xargs = request.get("vllm_xargs") or {}
            # the ticket rides to the engine (prepare claims it); the client sees only the group's id
            request["vllm_xargs"] = {**xargs, pl.ROUTE_KEYS["group"]: issued.ticket}
            body = json.dumps(request, ensure_ascii=False).encode()
            scope = dict(
                scope,
                headers=[(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
                + [(b"content-length", str(len(body)).encode())],
            )
            headers.append((GROUP_HEADER, issued.group.encode()))
            if info is not None and info.ranks > 1 and not any(k.lower() == RANK_HEADER for k, _ in scope["headers"]):
                rank = self._pin(admission.n * admission.prompts, info.ranks)
                scope = dict(scope, headers=[*scope["headers"], (RANK_HEADER, str(rank).encode())])
        try:
            await self._run(scope, _replay(body, receive), _Response(send, headers))
        finally:
            if rank is not None:
                self.load[rank] -= admission.n * admission.prompts
            if issued is not None:
                self._release(scope.get("app"), ISSUED.end(issued.ticket))

    def _pin(self, samples: int, ranks: int) -> int:
        start = next(self._turn)
        rank = min(((start + i) % ranks for i in range(ranks)), key=lambda r: self.load.get(r, 0))
        self.load[rank] = self.load.get(rank, 0) + samples
        return rank

    def _release(self, app, groups: list[str]) -> None:
        """Free ``groups``' Distiller slots on every rank (their request has ended), soon: the groups
        of requests that end meanwhile go along in the same call."""
        engine = getattr(getattr(app, "state", None), "engine_client", None)
        if not groups or engine is None or (self._stopping is not None and self._stopping.done()):
            return  # nothing to free, or the engine is stopping and its slots go with it
        self._releasing += groups
        if self._release_task is None or self._release_task.done():
            self._release_task = asyncio.ensure_future(self._flush_releases(engine))

    async def _flush_releases(self, engine) -> None:
        while self._releasing:
            groups, self._releasing = self._releasing, []
            try:
                await engine.collective_rpc("esamp_release", args=(groups,))
            except Exception as exc:  # a stopping engine: its slots go with it
                log.debug("ESamp: freeing %d groups' slots failed: %s", len(groups), exc)

    # -- /esamp/... ------------------------------------------------------------------------------

    async def _route(self, scope, path: str, send) -> None:
        routes = {"/esamp/metrics": self._metrics, "/esamp/records": self._records, "/esamp/config": self._config}
        handler = routes.get(path)
        if handler is None:
            await _respond(
                send,
                404,
                json.dumps(
                    {
                        "error": {
                            "message": f"no such ESamp route {shown(path, quote=False)}",
                            "type": "NotFoundError",
                            "param": None,
                            "code": 404,
                            "routes": list(ROUTES),
                        }
                    }
                ),
                "application/json",
            )
            return
        if scope["method"] not in ("GET", "HEAD"):
            await _respond(send, 405, json.dumps(_error(405, f"{path} answers GET only")), "application/json")
            return
        info = self._server(scope)
        if info is None:
            await _respond(
                send,
                503,
                json.dumps(
                    _error(
                        503,
                        "this server has no ESamp side channel (or has not "
                        "finished starting): start it with esamp serve",
                    )
                ),
                "application/json",
            )
            return
        if not self.secret and handler is not self._config:
            await _respond(
                send,
                503,
                json.dumps(
                    _error(
                        503,
                        f"the side channels take a per-launch secret, and {CHANNEL_SECRET_ENV} is not set in this "
                        f"server's environment: start it with esamp serve (or set {CHANNEL_SECRET_ENV} to a random "
                        "value for your own vllm serve line)",
                    )
                ),
                "application/json",
            )
            return
        await handler(scope, send, info)

    async def _config(self, scope, send, info: ServerInfo) -> None:
        out = asdict(info)
        out["channels"] = [f"http://{host}:{port}" for _, host, port in info.channels()]
        out["routes"] = self.routes  # the server's POST routes by kind: which generate, and how
        await _respond(send, 200, json.dumps(out), "application/json")

    async def _gather(self, info: ServerInfo, path: str) -> dict[int, tuple[int, bytes] | Exception]:
        async def one(host: str, port: int):
            try:
                return await fetch(host, port, path, self.secret)
            except (TimeoutError, OSError, ValueError) as exc:
                return exc

        channels = info.channels()
        got = await asyncio.gather(*(one(host, port) for _, host, port in channels))
        for (rank, host, port), result in zip(channels, got):
            self._heard(rank, f"{host}:{port}", result)
        return {rank: result for (rank, _, _), result in zip(channels, got)}

    def _heard(self, rank: int, where: str, result) -> None:
        """Log a rank's side channel going silent (and why) or answering again, once per change."""
        why = None
        if isinstance(result, Exception):
            why = f"{type(result).__name__}: {result}"
        elif result[0] >= 500:
            why = f"status {result[0]}: {result[1][:200].decode(errors='replace')}"
        if why is None and self._unanswered.pop(rank, None) is not None:
            log.info("ESamp side channel of rank %d on %s answers again", rank, where)
        elif why is not None and self._unanswered.get(rank) != why:
            self._unanswered[rank] = why
            log.warning("ESamp side channel of rank %d on %s did not answer (%s)", rank, where, why)

    async def _metrics(self, scope, send, info: ServerInfo) -> None:
        got = await self._gather(info, "/metrics")
        texts = {rank: r[1].decode() if isinstance(r, tuple) and r[0] == 200 else None for rank, r in got.items()}
        await _respond(send, 200, merge(texts), PROMETHEUS)

    async def _records(self, scope, send, info: ServerInfo) -> None:
        query = parse_qs(scope.get("query_string", b"").decode())
        groups = read_groups(query.get("group"))
        if isinstance(groups, str):
            await _respond(
                send,
                400,
                json.dumps(_error(400, groups.replace("/records", "/esamp/records"), "group")),
                "application/json",
            )
            return
        got = await self._gather(info, "/records?group=" + quote(",".join(sorted(groups)), safe=","))
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
        await _respond(
            send, 200, json.dumps({"steps": steps, "pending": pending, "unreachable": unreachable}), "application/json"
        )


def other_admission(request: dict, prompts_field: str | None):
    """A request on a ``routes.XARGS`` route, whose body is vLLM's to check: steered unless it says
    ``esamp: off`` (or its ``vllm_xargs`` is not a mapping: vLLM refuses that); a group or another key
    only the server sets refused; text checked for lone surrogates."""
    from esamp.engines.vllm.settings import refuse_server_keys
    from esamp.serving.admission import Admission

    refuse_surrogates(request)
    xargs = request.get("vllm_xargs")
    if isinstance(xargs, dict):
        try:
            refuse_server_keys(xargs)
        except ValueError as exc:
            raise Refused(str(exc), param="vllm_xargs") from None
    off = isinstance(xargs, dict) and str(xargs.get(pl.PREFIX, "on")).lower() in ("off", "false", "0")
    steered = bool(os.environ.get(SERVE_ENV)) and not off and (xargs is None or isinstance(xargs, dict))
    items = request.get(prompts_field) if prompts_field else None
    prompts = len(items) if isinstance(items, list) and items else 1
    records = isinstance(xargs, dict) and str(xargs.get(pl.ROUTE_KEYS["records"], "off")).lower() in ("on", "true", "1")
    if steered and records and prompts > 1:
        raise Refused(many_prompts_with_records(prompts), param=prompts_field)
    n = request.get("n")
    return Admission(
        steered=steered,
        n=n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1,
        prompts=prompts,
        records=records,
    )


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
    kind = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        405: "MethodNotAllowed",
        503: "ServiceUnavailable",
    }
    return {"error": {"message": message, "type": kind.get(code, "Error"), "param": param, "code": code}}


UNAUTHORISED = (
    "this server needs an API key: send the header 'Authorization: Bearer KEY' with the key it was "
    "started with (esamp serve --api-key KEY); esamp's own clients send $ESAMP_API_KEY"
)


async def _unauthorised(kind: str, receive, send) -> None:
    if kind == "websocket":
        message = await receive()
        if message["type"] == "websocket.connect":
            await send({"type": "websocket.close", "code": 1008, "reason": "API key required"})
        return
    data = json.dumps(_error(401, UNAUTHORISED)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def _respond(send, status: int, body: str, content_type: str) -> None:
    data = body.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})
