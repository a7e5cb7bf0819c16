"""A random-weight preset takes text: the embedded model's tokenizer stands in for the one it lacks
(``esamp-tui --engine vllm --model qwen2.5-7b:dummy`` runs a 7B-shaped model in the dashboard)."""

from __future__ import annotations

import pytest

from _vllm_helpers import require_vllm

pytestmark = [pytest.mark.vllm]


def test_a_random_weight_preset_reads_and_writes_text_through_a_stand_in_tokenizer(embedded_gguf):
    require_vllm()
    from esamp.core.config import EsampConfig, SamplingConfig
    from esamp.engines.base import run
    from esamp.engines.models import StandInTokenizer
    from esamp.engines.vllm.engine import VllmEngine

    engine = VllmEngine(model="qwen2.5-0.5b:dummy", esamp=EsampConfig(slots=4), max_model_len=256, max_num_seqs=8)
    try:
        assert isinstance(engine.tokenizer, StandInTokenizer) and engine.stop_ids == set()
        events = list(run(engine, "Name a colour.", SamplingConfig(n=2, max_tokens=6, seed=0)))
    finally:
        engine.close()
    tokens = [e for e in events if e.type == "token"]
    assert len(tokens) == 12 and all(isinstance(t.text, str) for t in tokens)
    assert any(t.text for t in tokens)  # ids past the lent vocabulary still read as some token
    assert [e.finish_reason for e in events if e.type == "done"] == ["length", "length"]
    assert any(e.type == "step" and e.port_hits for e in events)  # ESamp steered the random model too
