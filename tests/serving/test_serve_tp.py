"""Tensor parallelism on two GPUs: do the workers' Distiller banks stay identical?

``esamp serve`` refuses ``--tensor-parallel-size`` > 1 (README, "Scale-out"). Under tensor
parallelism every worker runs its own logits processor and Distiller bank on the same taps and
the same all-gathered logits, and samples its own copy of each token; vLLM needs those copies to
agree, so ESamp would need every worker's Distiller to stay equal bit for bit through training.
This test measures that on real hardware (the library engine, ``tensor_parallel_size=2``): a
steered workload runs for a while, then each worker reports a digest of its bank and its loss,
and they must be equal. If it passes reliably, the refusal can become a documented option; if it
fails, the README's plan (one worker owns the Distiller and broadcasts ŷ) is what TP needs.
"""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.cuda, pytest.mark.vllm]


def _bank_digest(worker) -> tuple[str, str, int]:
    """Runs inside each tensor-parallel worker (``collective_rpc`` with a function)."""
    import hashlib

    from esamp.engines.vllm.exchange import exchange_for

    steering = exchange_for(worker.vllm_config).steering
    store = steering.bank.store
    digest = hashlib.sha256()
    for tensor in (store.flat, store.flat_m, store.flat_v):
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest(), repr(steering.records.loss), steering.step_no


def test_tensor_parallel_workers_keep_identical_distillers():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (nvidia-h200-x2)")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    import sys

    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test file
    from esamp.core.config import EsampConfig, SamplingConfig, Steering
    from esamp.engines.vllm.engine import VllmEngine

    engine = VllmEngine(model="qwen2.5-0.5b:dummy", esamp=EsampConfig(slots=16), gpu_memory_utilization=0.3,
                        max_model_len=1024, llm_kwargs={"tensor_parallel_size": 2})
    try:
        for g in range(8):
            engine.start([100 + g + k for k in range(32)], SamplingConfig(n=4, max_tokens=256, seed=g,
                                                                        ignore_eos=True), Steering())
        while engine.step_count < 120:  # well into training, every group still holding its slot
            engine.step()
        digests = engine.engine.collective_rpc(_bank_digest)
        assert len(digests) == 2
        assert digests[0][2] > 0  # steps were steered
        assert digests[0] == digests[1], digests
    finally:
        engine.close()
