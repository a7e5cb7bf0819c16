"""How esamp asks vLLM for an engine: the facts the library engine and ``esamp serve`` share.

``model_facts`` reads a resolved model once (what vLLM loads, its ``config.json``, its shapes);
``engine_args`` turns it and the ESamp settings into vLLM's engine arguments: keywords of
``vllm.LLM`` for ``VllmEngine``, and the same arguments as ``vllm serve`` flags (``as_flags``) for
``esamp serve``. ``cpu_env`` holds what vLLM needs in its environment on a CPU. No vLLM import.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from esamp.engines.vllm import settings as es

EXTENSION = "esamp.engines.vllm.extension.EsampWorkerExtension"
GGUF_MODES = ("convert", "native")
# vLLM on a CPU sizes its KV cache from the node's memory unless told otherwise (and then fails on
# a busy machine); 4 GiB serves the dashboard and tests. Thread pinning off: it measured best on
# small shared machines.
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB of KV cache per worker on a CPU
CPU_ENV = {KV_ENV: "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
START_ENV = "VLLM_WORKER_MULTIPROC_METHOD"  # how vLLM starts its engine core and workers
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"  # vLLM's choice of model runner (docs/vllm.md)
THREADS_ENV = "OMP_NUM_THREADS"
MAX_MODEL_LEN = 4096  # the engine's context unless given, or the model's own if that is shorter
DEFAULT_DTYPE = "bfloat16"  # an HF model's dtype unless given: on a GPU, and on a CPU with bf16 arithmetic
# CPU_DTYPE on a CPU without it (x86 before AVX512-BF16/AMX, e.g. AVX2 only): vllm-cpu 0.30 on the
# embedded model ran 2.4x faster in float32 than in bfloat16 on a 2-core AVX2 machine (4 prompts of
# 300 tokens prefilled in 1.95 s against 4.67 s; 16 samples of 32 tokens in 4.9 s against 11.6 s),
# for twice the weights' memory.
CPU_DTYPE = "float32"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # /proc/cpuinfo's names (x86, x86, Arm)


@dataclass(frozen=True)
class ModelFacts:
    name: str
    load: dict[str, Any]  # how vLLM loads it: model, dtype, load format, tokenizer
    config_dir: Path  # the Hugging Face configuration's directory
    config: dict  # its config.json
    dummy: bool  # random weights: prompts are token ids

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def context_length(self) -> int | None:
        """The longest sequence the model was built for (``max_position_embeddings``), if it says."""
        value = self.config.get("max_position_embeddings")
        return int(value) if value else None

    @property
    def architecture(self) -> str:
        return (self.config.get("architectures") or ["LlamaForCausalLM"])[0]


def cpu_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this machine's CPU does bf16 arithmetic itself (``BF16_FLAGS`` among its flags in
    ``/proc/cpuinfo``, or ``cpuinfo`` given); False where that cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return bool(BF16_FLAGS & set(value.split()))
    return False


def default_dtype(*, cuda: bool) -> str:
    """An HF model's dtype when none is given: ``DEFAULT_DTYPE`` on a GPU or a CPU with bf16
    arithmetic, ``CPU_DTYPE`` on any other CPU."""
    return DEFAULT_DTYPE if cuda or cpu_bf16() else CPU_DTYPE


def model_facts(
    resolved,
    *,
    gguf: str = "convert",
    dtype: str | None = None,
    tokenizer: str | None = None,
    progress=None,
    cuda: bool,
) -> ModelFacts:
    """What vLLM loads for ``resolved`` (``esamp.engines.models.resolve``). ``gguf``: "convert" loads the
    cached bf16 HF directory of a GGUF model, "native" lets vLLM read the GGUF itself. ``dtype``
    unless given: ``default_dtype`` for the machine (``cuda``: vLLM runs on a GPU). ``progress``
    hears of a first start's GGUF conversion."""
    if gguf not in GGUF_MODES:
        from esamp.errors import ConfigError

        raise ConfigError(
            f"gguf must be one of {', '.join(GGUF_MODES)}, not {gguf!r}",
            hint="'convert' loads the cached bf16 HF directory; 'native' lets vLLM read the GGUF",
        )
    kind = resolved.kind
    if kind == "dummy":
        config_dir = Path(resolved.path)
        load = dict(
            model=str(config_dir),
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=dtype or default_dtype(cuda=cuda),
        )
    elif kind == "gguf" and gguf == "native":
        # vLLM 0.20 reads GGUF itself; fp16 activations (bf16/fp32 gave NaN logits there).
        config_dir = Path(resolved.hf_dir(progress))
        load = dict(
            model=str(resolved.path),
            dtype=dtype or "float16",
            tokenizer=str(Path(tokenizer or resolved.tokenizer or config_dir).resolve()),
        )
    else:  # an HF directory; a GGUF is dequantised once to a cached bf16 HF directory
        config_dir = Path(resolved.hf_dir(progress))
        load = dict(model=str(config_dir), dtype=dtype or default_dtype(cuda=cuda))
        if tokenizer:
            load["tokenizer"] = str(Path(tokenizer).resolve())
    config = json.loads((config_dir / "config.json").read_text())
    return ModelFacts(resolved.name, load, config_dir, config, kind == "dummy")


def context(facts: ModelFacts, given: int | None = None) -> int:
    """vLLM's ``max_model_len``: as given, else ``MAX_MODEL_LEN`` or the model's own if shorter
    (vLLM refuses a longer one)."""
    return given or min(MAX_MODEL_LEN, facts.context_length or MAX_MODEL_LEN)


def engine_args(facts: ModelFacts, esamp=None, *, cuda: bool) -> dict[str, Any]:
    """vLLM's engine arguments for ``facts`` with ESamp (``esamp``: an ``EsampConfig``) or
    without (None: the model's own class, no ESamp settings, as ``esamp bench``'s baseline)."""
    args = dict(facts.load)
    # The extension only adds methods (drain, info), so plain vLLM has it too.
    args["worker_extension_cls"] = EXTENSION
    if esamp is not None:
        args["hf_overrides"] = {"architectures": [es.esamp_architecture(facts.architecture)]}
        args["additional_config"] = {es.KEY: es.engine_settings(esamp, facts.num_layers)}
    if not cuda:
        args["enforce_eager"] = True
    return args


CPU_STEP_TOKENS = 4096  # vLLM's own budget of tokens per engine step on a CPU (vllm-cpu 0.30)
SCHEDULING = frozenset({"enable_chunked_prefill", "max_num_batched_tokens"})  # what ``scheduling`` sets


def scheduling(max_model_len: int, *, cuda: bool) -> dict[str, Any]:
    """vLLM's scheduling arguments. On a CPU every prompt is prefilled whole (no chunked prefill,
    ``CPU_STEP_TOKENS`` a step or the context if longer): after a partial prefill vLLM drops the
    token it sampled and rewinds a seeded request's generator, and a CPU generator has no offset to
    rewind ("CPU Generator does not use offset": the engine core dies). The library engine seeds
    every sample, so 16 samples of a 300-token prompt were enough. A GPU keeps vLLM's own."""
    if cuda:
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, CPU_STEP_TOKENS)}


def cpu_env(environ=os.environ) -> dict[str, str]:
    """vLLM's environment on a CPU: ``CPU_ENV`` unless the environment sets its own."""
    return {k: environ.get(k, v) for k, v in CPU_ENV.items()}


def cuda_env(environ=os.environ) -> dict[str, str]:
    """vLLM's environment on a GPU: its processes started with spawn unless the environment says
    otherwise. A process that has asked the CUDA driver anything (``torch.cuda.is_available()``,
    as libraries such as sentence-transformers do) cannot fork a child that uses CUDA: the child
    fails with "CUDA error: initialization error", and vLLM switches to spawn by itself only when
    torch has fully initialised CUDA."""
    return {} if START_ENV in environ else {START_ENV: "spawn"}


def start_method(workers_env: dict[str, str], environ=os.environ) -> str:
    """How vLLM will start its processes: as the environment or ``workers_env`` says, else its
    own default (fork)."""
    return environ.get(START_ENV) or workers_env.get(START_ENV) or "fork"


def spawns(tensor_parallel_size: int, workers_env: dict[str, str], environ=os.environ) -> bool:
    """Whether vLLM will start processes that import the main script again (spawn, forkserver):
    an engine core unless multiprocessing is off, and workers for tensor parallelism."""
    in_process = environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0" and tensor_parallel_size == 1
    return not in_process and start_method(workers_env, environ) != "fork"


def parallel_env(tensor_parallel_size: int, *, cuda: bool, environ=os.environ) -> dict[str, str]:
    """What vLLM needs in its environment for ``tensor_parallel_size`` workers, unless the
    environment says otherwise: the V1 runner, on which ESamp's tensor parallelism has run on GPUs
    (its Model Runner V2 adapter steers under tensor parallelism too, with ``RUNNER_ENV=1``: tested
    through vLLM's interface classes, not yet on several GPUs; docs/vllm.md); on a CPU each
    worker's share of esamp's default KV cache
    (vLLM gives every worker the whole ``VLLM_CPU_KVCACHE_SPACE``; another value is taken as
    given, per worker) and, without thread pinning, each worker's share of the cores as its
    OpenMP threads (each would otherwise start a thread per core)."""
    if tensor_parallel_size <= 1:
        return {}
    env = {RUNNER_ENV: environ.get(RUNNER_ENV, "0")}
    if not cuda:
        kv = CPU_ENV[KV_ENV]
        if environ.get(KV_ENV, kv) == kv:
            env[KV_ENV] = str(max(1, int(kv) // tensor_parallel_size))
        if cpu_env(environ)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind":
            env[THREADS_ENV] = environ.get(THREADS_ENV, str(max(1, (os.cpu_count() or 1) // tensor_parallel_size)))
    return {k: v for k, v in env.items() if environ.get(k) != v}


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """``values`` in this process's environment while an engine is built (vLLM reads them then,
    and the worker processes it starts inherit them), the environment as it was afterwards."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def as_flags(args: dict[str, Any]) -> list[str]:
    """Engine arguments as ``vllm serve`` flags (``model`` excluded: it is the positional one; a
    False one as ``--no-FLAG``, vLLM's form for a switch turned off; None left to vLLM)."""
    out: list[str] = []
    for key, value in args.items():
        if key == "model":
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag[2:])
        elif isinstance(value, (dict, list)):
            out += [flag, json.dumps(value, separators=(",", ":"))]
        elif value is not None:
            out += [flag, str(value)]
    return out
