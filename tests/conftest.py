import importlib.util
import os
import shutil
import sys

import pytest
import torch
from suite_resume import resume_from  # tests/ is on the path, as for this file

# Tests never reach a hub: a model id resolves from a cache the test builds, or from a local
# stand-in hub (tests/engines/_fake_hub.py) that a test names with HF_ENDPOINT.
os.environ["HF_HUB_OFFLINE"] = "1"
# The run's model cache (ESAMP_CACHE_DIR, else esamp's default), as it was before any test set one
# of its own: where ``embedded_model`` converts the embedded model, once.
RUN_CACHE = os.environ.get("ESAMP_CACHE_DIR")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ESAMP_TEST_ORDER") == "reverse":  # the GPU suite must pass in any order
        items.reverse()
    resume_from(config, items, os.environ.get("ESAMP_TEST_FROM"))
    no_cuda = not torch.cuda.is_available()
    no_vllm = importlib.util.find_spec("vllm") is None
    for item in items:
        if no_cuda and "cuda" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if no_vllm and "vllm" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs vLLM installed"))


def pytest_collection_finish(session):
    """Start the selected tests' Triton-interpreter checks in the background (tests/core/_interpreter.py):
    single-threaded runs of up to half a minute each that would otherwise run one after another."""
    interpreter = sys.modules.get("_interpreter")  # imported by the tests/core modules that have runs
    if interpreter is None or session.config.option.collectonly:
        return
    for item in session.items:
        code = getattr(getattr(item, "module", None), interpreter.RUNS, {}).get(item.originalname)
        skipped = item.get_closest_marker("skip") or any(m.args and m.args[0] for m in item.iter_markers("skipif"))
        if code and not skipped:
            interpreter.start_early(code)


def pytest_sessionfinish(session):
    interpreter = sys.modules.get("_interpreter")
    if interpreter is not None:
        interpreter.stop_early_runs()


@pytest.fixture(scope="session")
def reference_engine():
    """One reference engine on the embedded model for the whole test session."""
    from esamp.engines.reference import ReferenceEngine

    engine = ReferenceEngine()
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def embedded_gguf():
    """The embedded model's GGUF file; the test is skipped where its package is not installed."""
    from esamp.engines import models

    gguf = models.embedded_gguf()
    if gguf is None:
        pytest.skip(f"the embedded model's package ({models.EMBEDDED_PACKAGE}) is not installed")
    return gguf


@pytest.fixture(scope="session")
def embedded_model(embedded_gguf):
    """The embedded model's HF directory, converted once into the run's model cache, where every
    engine of the run finds it (a conversion takes about 30 s on 2 cores). A test with a model cache
    of its own links this directory in (tests/commands/test_bad_inputs.py) rather than converting
    again, unless a new conversion is its point (tests/engines/test_gguf_tokenizer.py)."""
    from esamp.engines import models

    with pytest.MonkeyPatch.context() as mp:  # the run's cache, whichever test asks first
        if RUN_CACHE is None:
            mp.delenv("ESAMP_CACHE_DIR", raising=False)
        else:
            mp.setenv("ESAMP_CACHE_DIR", RUN_CACHE)
        return models.convert_gguf(embedded_gguf)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory, embedded_model):
    """A random Gemma3ForCausalLM, two layers wide as a thumbnail, with the embedded tokenizer: the
    architecture of ``--model gemma3-270m`` for both engines' tests (tests/engines/test_gemma3.py,
    tests/engines/vllm/test_gemma3_vllm.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig

    folder = tmp_path_factory.mktemp("gemma3")
    tokenizer = AutoTokenizer.from_pretrained(embedded_model)  # its tokenizer is borrowed
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=16,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, embedded_model):
    """A random LlamaForCausalLM two layers deep with the embedded tokenizer, saved as a hub
    repository holds one (safetensors, tokenizer, generation config): what a hub id resolves to
    in the hub tests (tests/engines/test_hub.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(embedded_model)  # its tokenizer is borrowed
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
