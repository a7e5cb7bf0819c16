"""``esamp bench``'s worker extension (``esamp.commands.bench.worker_extension``), without an engine."""

from __future__ import annotations

import torch


def test_the_bench_rescales_the_head_in_blocks_from_the_weights_as_loaded(monkeypatch):
    """``--logits realistic``: factors apply to the weights as loaded (twice is not squared), in
    blocks of rows (a 7B head in float32 would not fit beside the bench's three engines), and
    None restores them."""
    from esamp.commands.bench import worker_extension as be

    monkeypatch.setattr(be, "HEAD_BLOCK", 3)
    weight = torch.arange(1.0, 15.0).reshape(7, 2).to(torch.bfloat16)
    loaded = weight.clone()
    worker = be.EsampBenchExtension.__new__(be.EsampBenchExtension)
    worker._esamp_head = lambda: (weight, None, 7, 0)
    factors = [0.5, 2.0, 1.0, 3.0, 0.25, 1.0, 2.0]
    expected = (loaded.float() * torch.tensor(factors).unsqueeze(1)).to(torch.bfloat16)
    worker.esamp_scale_head(factors)
    worker.esamp_scale_head(factors)
    assert torch.equal(weight, expected)
    worker.esamp_scale_head(None)
    assert torch.equal(weight, loaded) and worker._esamp_head_copy is None
