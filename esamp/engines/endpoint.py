"""``EndpointEngine``: the engine protocol as a client of a served endpoint (``esamp serve``).

``create_engine("server", url="http://host:port")``. A group is one streaming ``/v1/completions``
request with ``n`` samples: sample i is choice i (a seeded request's child i has seed + i, which
is how the server's processor numbers its samples), the steering travels in ``vllm_xargs`` (the
flat payload of ``esamp.core.payload``) with ``esamp_records: "on"``. The server names the
group (an unguessable id, in the response's ``X-Esamp-Group`` header: no client can join or read
another's group), and the per-token novelty comes from ``GET /esamp/records?group=ID`` (every
data-parallel rank's side channel, taken: each record once).

Step events follow the server's engine steps: every record (one engine step of one rank) becomes
one ``StepEvent`` with this client's rows of that step (rows = port hits: every steered row
samples one token) and a token rate on the server's clock; tokens of unsteered groups, which
have no records, become one event per poll (rows: the samples that advanced).

Events are the library engines' (``esamp.events``): the records say which engine step sampled
which (sample, generation index), exactly as the in-process vLLM engine's drain does, so the
bookkeeping that turns records and tokens into events is the in-process engine's
(``esamp.engines.record_streams``). A token is released once its
step's record is back (its novelty is the error of the step where it was the input), or, for a
sample the server could not steer, once the sample ended and every record has been read.

Text comes from the server (its detokenizer, as every OpenAI client sees it); token ids from
``return_token_ids``. When the server merges several tokens into one streamed chunk (a client that
reads slowly), the chunk's text goes with its last token, or with the one before when the last is
the stop token that ended the sample (never shown). Prompts are tokenised by the server
(``/tokenize``, with the chat template unless ``chat=False``); a model served without a
tokenizer (the dummy presets) takes token ids.

HTTP is the standard library's (one connection per group, read by a thread of its own), so a
client needs nothing beyond esamp's own dependencies.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from esamp.core import payload as pl
from esamp.core.config import EsampConfig, make_config
from esamp.engines.base import Group, RateMeter, StepStats, check_prompt_text, encode_prompt
from esamp.engines.record_streams import RecordedEngine, RecordedGroup, finish_reason
from esamp.errors import ConfigError, EngineError, PromptError
from esamp.events import Event

API_KEY_ENV = "ESAMP_API_KEY"
START_TIMEOUT = 120.0  # until the server answers a request's headers (it tokenises first)
# After a group's stream has ended, how long its last records may take before its remaining tokens
# go out without novelty (a rank whose side channel does not answer would otherwise hold them).
RECORD_GRACE = 3.0
GROUP_HEADER = "X-Esamp-Group"  # the server's id for a steered request's group


class _ClockedRate:
    """A ``RateMeter`` read at a given time (a record's time on the server's clock)."""

    def __init__(self, meter: RateMeter, now: float | None) -> None:
        self.meter, self.now = meter, now

    def add(self, tokens: int) -> float:
        return self.meter.add(tokens, now=self.now)


class _ServerText:
    """Stands in for a sample's detokenizer in ``GroupStream``: the server's text, token by token."""

    def __init__(self) -> None:
        self.texts: list[str] = []  # one per token received, in order
        self.read = 0

    def add(self, count: int, text: str) -> None:
        if count:
            self.texts += [""] * (count - 1) + [text]
        elif text and len(self.texts) > self.read:  # text the server held back, now released
            self.texts[-1] += text

    def stopped(self) -> None:
        """The last token is a stop token, which is never shown: text the server sent with it (a
        chunk that merged the sample's last tokens with it) goes to the token before it, unread
        until the stop token's step is fed."""
        if len(self.texts) >= 2 and self.texts[-1] and len(self.texts) - 2 >= self.read:
            self.texts[-2] += self.texts[-1]
            self.texts[-1] = ""

    def push(self, token_id: int) -> str:
        text = self.texts[self.read] if self.read < len(self.texts) else ""
        self.read += 1
        return text


@dataclass
class _ServedGroup(RecordedGroup):
    server_group: str = ""
    conn: Any = None
    cancelled: bool = False
    closed_at: float | None = None  # when its stream ended


class EndpointEngine(RecordedEngine):
    """A served ESamp endpoint as an engine (see the module docstring)."""

    name = "server"

    def __init__(
        self,
        url: str | None = None,
        model: str | None = None,
        esamp: EsampConfig | None = None,
        *,
        api_key: str | None = None,
        poll_interval: float = 0.05,
        timeout: float = START_TIMEOUT,
    ) -> None:
        """``url``: the server (``http://host:port``). ``model``: a served model name (default:
        the server's first). ``esamp``: only its steering is used, as the default for groups
        started without one; the engine-wide settings (taps, slots, ...) are the server's.
        ``api_key``: for a server started with ``--api-key`` (default: ``$ESAMP_API_KEY``)."""
        super().__init__(None)
        if not url:
            raise ConfigError(
                "the server engine needs the server's address",
                hint="pass --server http://HOST:PORT (a server started with esamp serve)",
            )
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"--server {url!r}: not an http(s) address", hint="e.g. --server http://127.0.0.1:8000")
        self.url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        self._parts = parts
        self.api_key = api_key or os.environ.get(API_KEY_ENV) or None
        self.timeout = timeout
        self.poll_interval = poll_interval
        self._inbox: queue.Queue = queue.Queue()
        self.server_rate = RateMeter()  # steered tokens per second, on the server's clock (record times)
        self._last_poll = 0.0
        self.counters: dict = {}
        self._chat_template: bool | None = None  # whether the served model has one, once asked

        info = self._server_info()
        served = self.request_json("GET", "/v1/models").get("data") or []
        names = [m.get("id") for m in served]
        if model is not None and model not in names:
            raise ConfigError(f"the server does not serve {model!r}", hint="it serves: " + ", ".join(map(str, names)))
        self.model_id = model or (names[0] if names else info["model"])
        entry = next((m for m in served if m.get("id") == self.model_id), {})
        server_esamp = make_config(EsampConfig, **info["esamp"])
        # The bank is the server's; the default steering the client's, when it gives one.
        self.esamp = server_esamp if esamp is None else server_esamp.model_copy(update={"steering": esamp.steering})
        self.context = int(entry.get("max_model_len") or info.get("max_model_len") or 0)
        self.hidden, self.num_layers = int(info.get("hidden_size", 0)), int(info.get("num_layers", 0))
        self.ranks = int(info.get("ranks", 1))
        self.tokenizer = None
        self.stop_ids = set()
        self.model_name = self.model_id
        self.device_name = f"server {parts.netloc}" + (f", {self.ranks} ranks" if self.ranks > 1 else "")
        self._loaded()

    # -- HTTP --------------------------------------------------------------------------------

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._parts.scheme == "https" else http.client.HTTPConnection
        return kind(self._parts.hostname, self._parts.port, timeout=timeout)

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def request_json(self, method: str, path: str, body: dict | None = None, timeout: float = 30.0) -> dict:
        """One request; the JSON answer, or an ``EngineError`` with the server's own reason."""
        conn = self._connection(timeout)
        try:
            conn.request(
                method,
                self._parts.path.rstrip("/") + path,
                body=None if body is None else json.dumps(body),
                headers=self._headers(),
            )
            response = conn.getresponse()
            status, data = response.status, response.read()
        except OSError as exc:
            raise EngineError(
                f"no answer from the server at {self.url}: {exc}",
                hint="is it running? start one with esamp serve MODEL --port PORT",
            ) from None
        finally:
            conn.close()
        if status != 200:
            raise _server_error(status, data, f"{method} {path}", sent_key=bool(self.api_key))
        try:
            return json.loads(data)
        except ValueError:
            raise EngineError(
                f"{method} {path}: the server's answer is not JSON", hint=f"is {self.url} an esamp serve endpoint?"
            ) from None

    def _server_info(self) -> dict:
        try:
            return self.request_json("GET", "/esamp/config")
        except EngineError as exc:
            if getattr(exc, "status", None) in (404, 503):
                raise EngineError(
                    f"{self.url} serves no ESamp ({exc.message})",
                    hint="start the server with esamp serve MODEL (docs/serving.md)",
                ) from None
            raise

    def info(self) -> dict:
        return self.request_json("GET", "/esamp/config")

    @property
    def has_chat_template(self) -> bool:
        """Whether the server applies a chat template to a prompt: asked once, as ``/tokenize``
        refuses a chat for a model without one (``_tokenize`` then sends the text as it is)."""
        if self._chat_template is None:
            body = {
                "model": self.model_id,
                "messages": [{"role": "user", "content": "Hi"}],
                "add_generation_prompt": True,
            }
            try:
                self.request_json("POST", "/tokenize", body)
                self._chat_template = True
            except (ConfigError, EngineError) as exc:
                if "chat template" not in exc.message.lower():
                    raise
                self._chat_template = False
        return self._chat_template

    # -- admission ---------------------------------------------------------------------------

    def encode(self, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
        if isinstance(prompt, str):
            check_prompt_text(prompt)
            ids = self._tokenize(prompt, chat)
        else:
            ids = prompt
        return encode_prompt(None, ids, False, self.context)  # its checks: empty, longer than the context

    def _tokenize(self, prompt: str, chat: bool) -> list[int]:
        body: dict = {"model": self.model_id}
        if chat:
            body.update(messages=[{"role": "user", "content": prompt}], add_generation_prompt=True)
        else:
            body.update(prompt=prompt)
        try:
            return list(self.request_json("POST", "/tokenize", body)["tokens"])
        except (ConfigError, EngineError) as exc:  # the server's refusal (400) or failure
            text = exc.message.lower()
            if chat and "chat template" in text:  # a model without one: the prompt as plain text
                return self._tokenize(prompt, chat=False)
            if "tokenizer" in text:
                raise PromptError(
                    f"{self.model_id} is served without a tokenizer: give the prompt as token ids",
                    hint="pass a list of token ids, or serve a model with a tokenizer",
                ) from None
            raise

    def _admit(self, group: Group) -> _ServedGroup:
        g = _ServedGroup(**vars(group))
        s = g.sampling
        g.arrived = [[] for _ in range(s.n)]
        g.fed = [0] * s.n
        g.stream.detok = [_ServerText() for _ in range(s.n)]  # the server's text, not a local detokenizer
        # Steered: every steering setting explicitly (not the server's defaults), and its records
        # kept for this client (the server names the group). Off: plain sampling, no Distiller, no records.
        xargs = pl.encode(g.steering, records=True) if g.steered else {pl.PREFIX: "off"}
        body = {
            "model": self.model_id,
            "prompt": g.prompt_ids,
            "n": s.n,
            "max_tokens": g.max_new,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "min_p": s.min_p,
            "ignore_eos": s.ignore_eos,
            "stop": s.stop,
            "stream": True,
            "return_token_ids": True,
            "vllm_xargs": xargs,
        }
        if s.seed is not None:
            body["seed"] = s.seed
        conn = self._connection(self.timeout)
        try:
            conn.request(
                "POST",
                self._parts.path.rstrip("/") + "/v1/completions",
                body=json.dumps(body),
                headers={**self._headers(), "Accept": "text/event-stream"},
            )
            response = conn.getresponse()
        except OSError as exc:
            conn.close()
            raise EngineError(
                f"the server at {self.url} did not take the request: {exc}",
                hint="is it still running? the other groups keep going",
            ) from None
        if response.status != 200:
            data = response.read()
            conn.close()
            raise _server_error(response.status, data, "the request", sent_key=bool(self.api_key))
        if g.steered:
            g.server_group = response.getheader(GROUP_HEADER) or ""
            if not g.server_group:
                conn.close()
                raise EngineError(
                    f"the server at {self.url} did not name the request's ESamp group (no "
                    f"{GROUP_HEADER} header), so its novelty cannot be read",
                    hint="serve with esamp serve of this esamp version",
                )
        if conn.sock is not None:  # a request may wait in vLLM's queue for long before its first token
            conn.sock.settimeout(None)
        g.conn = conn
        threading.Thread(
            target=self._read_stream, args=(g, response), name=f"esamp-stream-{g.key}", daemon=True
        ).start()
        return g

    def _read_stream(self, g: _ServedGroup, response) -> None:
        """The group's server-sent events → the inbox (this thread), until [DONE] or the end."""
        put = self._inbox.put
        try:
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    error = chunk["error"]
                    put(("error", g.key, error.get("message", str(error)) if isinstance(error, dict) else str(error)))
                    break
                for choice in chunk.get("choices", ()):
                    put(
                        (
                            "tokens",
                            g.key,
                            choice["index"],
                            list(choice.get("token_ids") or ()),
                            choice.get("text") or "",
                            choice.get("finish_reason"),
                            choice.get("stop_reason"),
                        )
                    )
        except Exception as exc:  # a broken connection, or one we closed to abort
            if not g.cancelled:
                put(("error", g.key, f"the stream from the server broke: {type(exc).__name__}: {exc}"))
        finally:
            put(("closed", g.key))
            try:
                g.conn.close()
            except Exception:
                pass

    def _cancel(self, g: _ServedGroup) -> None:
        """Close the group's connection: the server aborts its requests when the client goes."""
        g.cancelled = True
        sock = getattr(g.conn, "sock", None)
        try:
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _release(self, g: _ServedGroup) -> None:
        """Nothing to give back: the server frees an idle group's Distiller slot itself."""

    def _shutdown(self) -> None:
        pass

    # -- the loop ----------------------------------------------------------------------------

    def drain(self) -> dict:
        """The running steered groups' records from every rank of the server (taken)."""
        keys = {g.server_group: key for key, g in self.groups.items() if g.steered}
        if not keys:
            return {"steps": [], "pending": 0, "unreachable": []}
        out = self.request_json("GET", "/esamp/records?group=" + quote(",".join(sorted(keys)), safe=","))
        for rec in out["steps"]:  # the server's group keys back to this client's
            rec["rows"] = [(keys.get(r[0], r[0]), *r[1:]) for r in rec["rows"]]
            rec["loss"] = {keys.get(k, k): v for k, v in rec["loss"].items()}
        return out

    def _collect(self) -> list[tuple]:
        """What the streams delivered since the last step (waiting briefly when nothing has)."""
        items = []
        try:
            items.append(self._inbox.get(timeout=self.poll_interval if self.groups else 0))
            while True:
                items.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return items

    def step(self) -> list[Event]:
        plain_tokens = 0
        advanced: set[tuple[str, int]] = set()  # (group, sample) of unsteered groups that got tokens
        failed: dict[str, str] = {}
        for kind, key, *rest in self._collect():
            g = self.groups.get(key)
            if g is None:
                continue
            if kind == "tokens":
                sample, ids, text, finish, stop = rest
                g.arrived[sample].extend(ids)
                g.stream.detok[sample].add(len(ids), text)
                if not g.steered and ids:
                    plain_tokens += len(ids)
                    advanced.add((key, sample))
                if finish is not None:
                    g.final[sample] = finish_reason(finish)
                    # Ended by a stop token (not a stop string): the token is in the ids and, as in
                    # the library engines, not shown. Stop tokens end a sample, so it is the last.
                    if finish == "stop" and (stop is None or isinstance(stop, int)) and g.arrived[sample]:
                        g.stream.stop_ids = g.stream.stop_ids | {g.arrived[sample][-1]}
                        g.stream.detok[sample].stopped()
            elif kind == "error":
                failed[key] = rest[0]
            elif kind == "closed":
                g.closed_at = time.monotonic()
                for sample in range(g.sampling.n):  # a stream that ended without finishing a sample
                    g.final.setdefault(sample, "abort" if g.cancelled else "error")
        steps: list[Event] = []
        all_back = False
        now = time.perf_counter()
        if any(g.steered for g in self.groups.values()) and now - self._last_poll >= self.poll_interval:
            self._last_poll = now
            drained = self.drain()  # read after the tokens above: every record of theirs is in it
            for rec in sorted(drained["steps"], key=lambda r: (r.get("time", 0.0), r.get("rank", 0), r["step"])):
                stats = StepStats()
                self._file(rec, stats)
                if stats.port_hits:  # one engine step of one rank: this client's rows in it
                    stats.tokens = stats.rows = stats.port_hits
                    steps.append(self._event(stats, _ClockedRate(self.server_rate, rec.get("time"))))
            all_back = drained.get("pending", 0) == 0 and not drained.get("unreachable")
        if plain_tokens:
            steps.append(self._event(StepStats(tokens=plain_tokens, rows=len(advanced)), self.rate))

        def advance(g: _ServedGroup) -> list[Event]:
            if g.key in failed:
                raise EngineError(failed[g.key])
            overdue = g.closed_at is not None and time.monotonic() - g.closed_at > RECORD_GRACE
            return self._advance(g, all_back or overdue)

        return self._advance_groups(advance, StepStats()) + steps

    def _event(self, stats: StepStats, rate) -> Event:
        event = stats.event(self.step_count, rate)
        self.step_count += 1
        return event


def _server_error(status: int, data: bytes, what: str, sent_key: bool = False) -> EngineError:
    """The server's refusal as an error a user can act on (its message says what to change)."""
    try:
        error = json.loads(data).get("error")
        message = error.get("message") if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        message = data.decode(errors="replace")[:300] or f"HTTP {status}"
    if status == 401:
        err = EngineError(
            f"the server refused {what} (HTTP 401): "
            + (f"it does not take the API key in {API_KEY_ENV}" if sent_key else "it needs an API key"),
            hint=f"set {API_KEY_ENV} to the key the server was started with (esamp serve --api-key KEY)",
        )
    else:
        kind = ConfigError if status == 400 else EngineError
        err = kind(
            f"the server refused {what} (HTTP {status}): {message}",
            hint="change the setting the message names"
            if status == 400
            else "check the server's log; esamp serve prints where it listens",
        )
    err.status = status
    return err
