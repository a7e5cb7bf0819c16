"""The client engine (``create_engine("server")``) against a scripted stand-in for a served endpoint:
how streamed chunks and novelty records become the library engines' events, and every way a server
can fail it. No vLLM needed."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from esamp.core.config import EsampConfig, SamplingConfig, Steering
from esamp.engines import create_engine
from esamp.errors import ConfigError, EngineError, PromptError

# Two samples. Sample 0: three tokens, the last two in one chunk (a client that read slowly);
# sample 1: one token, then the stop token (id 2), which is not shown.
CHUNKS = [
    {"index": 0, "token_ids": [10], "text": "a"},
    {"index": 1, "token_ids": [20], "text": "b"},
    {"index": 0, "token_ids": [11, 12], "text": "cd", "finish_reason": "length"},
    {"index": 1, "token_ids": [2], "text": "", "finish_reason": "stop", "stop_reason": None},
]
# (sample, generation index): the step that sampled token k of a sample leaves the row k
ROWS = [[(0, 0, 1.0), (1, 0, 1.1)], [(0, 1, 1.2), (1, 1, 1.3)], [(0, 2, 1.4)]]


class Script:
    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.groups: dict[str, bool] = {}  # group → records already taken
        self.refuse: str | None = None
        self.stream_error: str | None = None
        self.esamp = True
        self.tokenizer = True
        self.unreachable = False  # the rank holding the records does not answer
        self.name_groups = True  # False: a server that does not say a request's group
        self.api_key: str | None = None
        self.chunks: list[dict] = CHUNKS  # what the stream sends, choice by choice


def make_handler(script: Script):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _json(self, status, obj):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _refused(self) -> bool:
            if script.api_key and self.headers.get("Authorization") != f"Bearer {script.api_key}":
                self._json(401, {"error": {"message": "this server needs an API key", "code": 401}})
                return True
            return False

        def do_GET(self):  # noqa: N802
            if self._refused():
                return
            if self.path == "/esamp/config" and script.esamp:
                self._json(
                    200,
                    {
                        "esamp": EsampConfig(slots=4).model_dump(),
                        "ranks": 1,
                        "model": "tiny",
                        "hidden_size": 16,
                        "num_layers": 2,
                        "max_model_len": 64,
                    },
                )
            elif self.path == "/v1/models":
                self._json(200, {"data": [{"id": "tiny", "max_model_len": 64}]})
            elif self.path.startswith("/esamp/records?group="):
                groups = self.path.split("=", 1)[1].split(",")
                steps = []
                for g in groups:
                    if not script.groups.get(g, True) and not script.unreachable:
                        steps += [
                            {"step": i + 1, "rows": [[g, s, k, e, 5] for s, k, e in rows], "loss": {g: 0.5}}
                            for i, rows in enumerate(ROWS)
                        ]
                        script.groups[g] = True
                self._json(200, {"steps": steps, "pending": 0, "unreachable": [1] if script.unreachable else []})
            else:
                self._json(404, {"error": {"message": f"no such path {self.path}"}})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self._refused():
                return
            script.bodies.append(body)
            if self.path == "/tokenize":
                if not script.tokenizer:
                    self._json(400, {"error": {"message": "Unable to get tokenizer because skip_tokenizer_init=True"}})
                else:
                    self._json(200, {"tokens": [5, 6, 7] if "messages" in body else [5]})
                return
            if script.refuse:
                self._json(400, {"error": {"message": script.refuse, "type": "BadRequestError", "code": 400}})
                return
            xargs = body.get("vllm_xargs", {})
            assert "esamp_group" not in xargs  # the server names groups
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            if xargs.get("esamp") != "off" and script.name_groups:
                group = f"eg-{len(script.groups)}"
                script.groups[group] = False
                self.send_header("X-Esamp-Group", group)
            self.end_headers()
            chunks = (
                [{"error": {"message": script.stream_error}}]
                if script.stream_error
                else [{"choices": [c]} for c in script.chunks]
            )
            for chunk in chunks:
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    return Handler


@pytest.fixture
def fake():
    script = Script()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(script))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    script.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield script
    server.shutdown()
    server.server_close()


def events_of(engine, key):
    events = []
    while engine.has_unfinished():
        events += engine.step()
    return [e for e in events if getattr(e, "group", key) == key]


@pytest.mark.parametrize("steered", [True, False])
def test_chunks_and_records_become_the_library_engines_events(fake, steered):
    engine = create_engine("server", url=fake.url, esamp=EsampConfig(beta=2.0, slots=99))
    assert engine.esamp.slots == 4 and engine.esamp.steering.beta == 2.0  # the server's bank, the client's default β
    assert (engine.ready.engine, engine.ready.model, engine.ready.context) == ("server", "tiny", 64)
    key = engine.start("Hi", SamplingConfig(n=2, max_tokens=10, seed=3), Steering(beta=1.5, enabled=steered))
    body = fake.bodies[-1]
    assert body["prompt"] == [5, 6, 7] and body["n"] == 2 and body["seed"] == 3 and body["stream"]
    assert body["return_token_ids"] and body["max_tokens"] == 10
    if steered:
        assert body["vllm_xargs"]["esamp_beta"] == 1.5 and body["vllm_xargs"]["esamp_records"] == "on"
        assert "esamp_group" not in body["vllm_xargs"]  # the server names the group
    else:
        assert body["vllm_xargs"] == {"esamp": "off"}
    events = events_of(engine, key)
    tokens = [(e.sample, e.index, e.token_id, e.text, e.novelty is not None) for e in events if e.type == "token"]
    novel = steered
    assert sorted(tokens) == [
        (0, 0, 10, "a", novel),
        (0, 1, 11, "", novel),
        (0, 2, 12, "cd", False),
        (1, 0, 20, "b", novel),
    ]  # the stop token is not shown; its input's novelty is
    assert sorted((e.sample, e.finish_reason, e.tokens) for e in events if e.type == "done") == [
        (0, "length", 3),
        (1, "stop", 1),
    ]
    steps = [e for e in events if e.type == "step"]
    assert sum(e.port_hits for e in steps) == (5 if steered else 0)
    # One step event per engine step of the server: ESamp on in every one of a steered run, off in
    # every one of a plain run, and rows (the samples decoded) equal to the rows steered.
    assert {e.esamp for e in steps} == {steered}
    if steered:
        assert [(e.rows, e.port_hits) for e in steps] == [(2, 2), (2, 2), (1, 1)]
        assert all(e.loss == 0.5 and e.candidates == 5 for e in steps)
        assert all(e.losses == {key: [0.5]} for e in steps)  # each group's own loss, per step
    else:
        assert sum(e.rows for e in steps) >= 2 and all(e.rows <= 2 for e in steps)
    for sample in (0, 1):  # per sample: indexes in order, done after the last token
        mine = [e for e in events if getattr(e, "sample", None) == sample]
        assert [e.index for e in mine if e.type == "token"] == sorted(e.index for e in mine if e.type == "token")
        assert mine[-1].type == "done"


def test_text_sent_with_the_stop_token_is_shown_with_the_token_before_it(fake):
    """A chunk that merges a sample's last tokens with the stop token that ended it (a client that
    read slowly) carries their text with the stop token, which is never shown: the text goes with
    the last token shown, nothing lost (a plain group: a steered one's text takes the same path)."""
    fake.chunks = [
        {"index": 0, "token_ids": [10], "text": "a"},
        {"index": 0, "token_ids": [11, 12, 2], "text": "bcd", "finish_reason": "stop", "stop_reason": None},
    ]
    engine = create_engine("server", url=fake.url)
    key = engine.start("Hi", SamplingConfig(n=1, max_tokens=10), Steering(enabled=False))
    events = events_of(engine, key)
    tokens = [(e.index, e.token_id, e.text) for e in events if e.type == "token"]
    assert tokens == [(0, 10, "a"), (1, 11, ""), (2, 12, "bcd")]
    assert [(e.finish_reason, e.tokens) for e in events if e.type == "done"] == [("stop", 3)]


def test_prompts_as_text_or_token_ids(fake):
    engine = create_engine("server", url=fake.url)
    engine.start("Hi", SamplingConfig(n=1, max_tokens=4), chat=False)
    assert fake.bodies[-2] == {"model": "tiny", "prompt": "Hi"} and fake.bodies[-1]["prompt"] == [5]
    engine.start([1, 2, 3], SamplingConfig(n=1, max_tokens=4))
    assert fake.bodies[-1]["prompt"] == [1, 2, 3]
    with pytest.raises(PromptError):
        engine.start(list(range(100)), SamplingConfig(n=1))  # longer than the served context
    fake.tokenizer = False
    with pytest.raises(PromptError) as err:
        engine.start("Hi", SamplingConfig(n=1))
    assert "token ids" in err.value.message
    engine.close()


def test_the_servers_refusal_is_raised_at_start_with_its_reason(fake):
    engine = create_engine("server", url=fake.url)
    fake.refuse = "n=70: an ESamp group holds at most 64 samples"
    with pytest.raises(ConfigError) as err:
        engine.start("Hi", SamplingConfig(n=2))
    assert "HTTP 400" in err.value.message and "n=70" in err.value.message and err.value.hint
    assert not engine.has_unfinished()


def test_an_error_inside_the_stream_ends_that_group_with_an_error(fake):
    engine = create_engine("server", url=fake.url)
    fake.stream_error = "the engine died"
    key = engine.start("Hi", SamplingConfig(n=2))
    events = events_of(engine, key)
    error = next(e for e in events if e.type == "error")
    assert "the engine died" in error.message and error.group == key and not error.fatal
    assert sorted((e.sample, e.finish_reason) for e in events if e.type == "done") == [(0, "abort"), (1, "abort")]


def test_servers_that_cannot_serve_are_named(fake):
    with pytest.raises(ConfigError):
        create_engine("server")
    with pytest.raises(ConfigError):
        create_engine("server", url="ftp://host")
    with pytest.raises(ConfigError) as err:
        create_engine("server", url=fake.url, model="other")
    assert "tiny" in err.value.hint
    fake.esamp = False  # a plain vLLM server: no /esamp/config
    with pytest.raises(EngineError) as err:
        create_engine("server", url=fake.url)
    assert "serves no ESamp" in err.value.message and "esamp serve" in err.value.hint
    with pytest.raises(EngineError) as err:
        create_engine("server", url="http://127.0.0.1:9")  # nothing listens there
    assert "no answer" in err.value.message and "esamp serve" in err.value.hint


def test_records_that_never_come_do_not_hold_the_tokens_forever(fake, monkeypatch):
    """A rank whose side channel does not answer: the samples still end, their tokens without novelty."""
    import esamp.engines.endpoint as server

    monkeypatch.setattr(server, "RECORD_GRACE", 0.2)
    fake.unreachable = True
    engine = create_engine("server", url=fake.url)
    key = engine.start("Hi", SamplingConfig(n=2, max_tokens=10), Steering())
    events = events_of(engine, key)
    tokens = [e for e in events if e.type == "token"]
    assert len(tokens) == 4 and all(t.novelty is None for t in tokens)
    assert sorted((e.sample, e.finish_reason) for e in events if e.type == "done") == [(0, "length"), (1, "stop")]


def test_a_server_that_wants_a_key_names_the_variable(fake, monkeypatch):
    monkeypatch.delenv("ESAMP_API_KEY", raising=False)
    fake.api_key = "k"
    with pytest.raises(EngineError) as err:
        create_engine("server", url=fake.url)
    assert "HTTP 401" in err.value.message and "ESAMP_API_KEY" in err.value.hint and "--api-key" in err.value.hint
    with pytest.raises(EngineError) as err:
        create_engine("server", url=fake.url, api_key="wrong")
    assert "does not take the API key in ESAMP_API_KEY" in err.value.message
    monkeypatch.setenv("ESAMP_API_KEY", "k")
    engine = create_engine("server", url=fake.url)
    key = engine.start("Hi", SamplingConfig(n=2, max_tokens=10), Steering())
    assert sorted(e.sample for e in events_of(engine, key) if e.type == "done") == [0, 1]


def test_a_server_that_does_not_name_the_group_is_an_error(fake):
    fake.name_groups = False
    engine = create_engine("server", url=fake.url)
    with pytest.raises(EngineError) as err:
        engine.start("Hi", SamplingConfig(n=2), Steering())
    assert "X-Esamp-Group" in err.value.message and not engine.has_unfinished()
