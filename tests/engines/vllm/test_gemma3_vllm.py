"""Gemma 3 (``--model gemma3-270m``) on the vLLM engine: ``EsampGemma3ForCausalLM``.

On a small random Gemma3ForCausalLM (``tiny_gemma3``, tests/conftest.py; the reference engine's
tests use the same one) the engine picks the Gemma 3 tap from the architecture, every steered row's
taps are what the reference engine's Distiller sees for the same layers (its hooks on the tapped
layers' ``input_layernorm``), the logits are the Hugging Face model's, and ESamp steers. The real
model runs where its package is installed. One engine serves the module.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from esamp.engines import models

from _tracing import TRACER, collect, exchange, tokens_of, traced
from _vllm_helpers import cuda, require_vllm

pytestmark = [pytest.mark.vllm]

PROMPT_A = "What is the capital of France?"
PROMPT_B = "Write one sentence about the sea."
GEMMA3_PACKAGE = models.PACKAGED["gemma3-270m"]


def sampling(**kw):
    from esamp.core.config import SamplingConfig

    return SamplingConfig(**{"n": 1, "max_tokens": 8, "seed": 1, **kw})


def steer(**kw):
    from esamp.core.config import Steering

    return Steering(**kw)


@pytest.mark.skipif(
    importlib.util.find_spec(GEMMA3_PACKAGE.module) is None,
    reason=f"the gemma3-270m package is not installed (pip install {GEMMA3_PACKAGE.pip})",
)
def test_the_real_gemma3_270m_generates_and_steers_on_vllm():
    """First in the module, so its engine is gone before the small model's starts."""
    require_vllm()
    from esamp.core.config import EsampConfig
    from esamp.engines.base import run
    from esamp.engines.vllm.engine import VllmEngine

    engine = VllmEngine(model="gemma3-270m", esamp=EsampConfig(slots=2), max_model_len=512)
    try:
        info = engine.info()
        assert engine.model_name == "gemma3-270m" and info["model_class"] == "EsampGemma3ForCausalLM"
        assert tuple(info["taps"]) == (0, engine.num_layers - 1)
        events = list(run(engine, "Name a colour.", sampling(n=2, max_tokens=8), steer()))
        assert sum(e.type == "done" for e in events) == 2
        steps = [e for e in events if e.type == "step"]
        assert sum(s.port_hits for s in steps) > 0 and any(s.loss is not None for s in steps)
        # vLLM tokenizes with the converted tokenizer: BOS first and whole words, or Gemma 3
        # decodes " 1 1 1 ..." (what transformers 5.17's conversion gave on the GPU)
        text = "".join(
            e.text
            for e in run(engine, "The capital of France is", sampling(temperature=0.0), steer())
            if e.type == "token"
        )
        assert "Paris" in text, text
    finally:
        engine.close()


@pytest.fixture(scope="module")
def engine(tiny_gemma3):
    require_vllm()
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm.engine import VllmEngine

    eng = VllmEngine(
        model=str(tiny_gemma3),
        esamp=EsampConfig(slots=4),
        max_model_len=512,
        llm_kwargs={"enable_prefix_caching": False, "logits_processors": [TRACER]},
    )
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(engine):
    """The reference engine on the same weights: ``rows(ids)`` is what its Distiller gets at the
    last position of ``ids`` (its own tap hooks), with the model's logits there, in fp32."""
    from esamp.engines.reference import ReferenceEngine

    ref = ReferenceEngine(
        model=str(engine.resolved.hf_dir()), esamp=engine.esamp, device="cuda" if cuda() else "cpu", threads=2
    )

    def rows(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            out = ref.model(input_ids=torch.tensor([ids], device=ref.device))
        source, target = ref.taps.take()
        return source[0].float().cpu(), target[0].float().cpu(), out.logits[0, -1].float().cpu()

    yield rows
    ref.close()


def test_the_gemma3_tap_is_chosen_from_the_architecture(engine):
    from esamp.engines.vllm import settings as es

    assert es.esamp_architecture("Gemma3ForCausalLM") == "EsampGemma3ForCausalLM"
    info = engine.info()
    assert info["model_class"] == "EsampGemma3ForCausalLM"
    assert tuple(info["taps"]) == (0, engine.num_layers - 1) == (0, 1)
    assert info["runner_module"].startswith("vllm.v1.worker.") and info["processor"]


def test_taps_and_logits_equal_the_reference_engines_in_a_mixed_batch(engine, reference):
    """Every steered row (prefill and decode rows of two groups in one step, and past the
    16-token sliding window) carries the reference engine's taps for the same layers, after the
    same norms, and the Hugging Face model's logits."""
    with traced() as trace:
        greedy = dict(temperature=0.0, max_tokens=14)
        keys, events = collect(
            engine,
            {
                0: [dict(prompt=PROMPT_A, sampling=sampling(n=2, **greedy), steering=steer(beta=0.0))],
                1: [dict(prompt=PROMPT_B, sampling=sampling(n=1, **greedy), steering=steer(beta=0.0))],
            },
        )
    prompts = {keys[0]: engine.encode(PROMPT_A), keys[1]: engine.encode(PROMPT_B)}
    assert any(
        {m[0] for m in t["meta"]} == set(keys) and {m[2] == 0 for m in t["meta"]} == {True, False} for t in trace
    ), "no step mixed a prefill row with decode rows"
    worst = {"source": 0.0, "target": 0.0, "logits": 0.0}
    longest = checked = 0
    for t in trace:
        for row, (group, sample, k) in enumerate(t["meta"]):
            seq = (prompts[group] + tokens_of(events, group, sample))[: len(prompts[group]) + k]
            longest = max(longest, len(seq))
            src, tgt, logits = reference(seq)
            for name, ours, theirs in (
                ("source", t["source"][row], src),
                ("target", t["target"][row], tgt),
                ("logits", t["logits"][row], logits),
            ):
                worst[name] = max(worst[name], float((ours.float().cpu() - theirs).norm() / theirs.norm()))
            checked += 1
    assert checked >= 20 and longest > 16
    # bf16 activations in vLLM against the fp32 reference
    assert worst["source"] < 0.01 and worst["target"] < 0.02 and worst["logits"] < 0.05, worst


def test_esamp_steers_the_gemma3_model(engine):
    """Default steering (β = 0.8): every sample ends, every step feeds the Distiller (port hits,
    a loss), no step misses its taps, and the one head GEMM over [h; ŷ] gives d = W·ŷ with
    Gemma's head (tied to the embeddings, no soft cap)."""
    with traced() as trace:
        keys, events = collect(engine, {0: [dict(prompt=PROMPT_B, sampling=sampling(n=4, max_tokens=16, seed=5))]})
    assert sorted(e.sample for e in events if e.type == "done") == [0, 1, 2, 3]
    assert all(tokens_of(events, keys[0], i) for i in range(4))
    steps = [e for e in events if e.type == "step"]
    assert sum(s.port_hits for s in steps) > 0 and any(s.loss is not None and s.loss > 0 for s in steps)
    counters = engine.drain()["counters"]
    assert counters.get("taps_missing", 0) == 0 and counters["port_hits"] > 0
    model = exchange().model
    assert model._esamp_plain_head() and model.config.tie_word_embeddings
    head = model.esamp_lm_head()
    assert head.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert trace
    for t in trace:
        d = (t["prediction"].to(head.dtype) @ head[: t["logits"].shape[1]].t()).float()
        assert torch.allclose(t["distiller_logits"].cpu(), d.cpu(), atol=0.05, rtol=1e-2)
