"""Pieces of the vLLM engine that need no engine: settings, the candidate filter, the bank."""

from __future__ import annotations

import pytest
import torch

from esamp import intervention as iv
from esamp.config import EsampConfig, SamplingConfig
from esamp.distiller import DistillerBank, RowLayout
from esamp.engines.vllm import settings as es
from esamp.engines.vllm.bank import FlatDistillerBank
from esamp.engines.vllm.filters import sampler_candidate_mask
from esamp.errors import ConfigError


def test_settings_round_trip_and_neutral_filters():
    s = SamplingConfig(temperature=0.7, top_p=0.9, min_p=0.05, top_k=20)
    extra = {es.KEY: es.request_settings("g", 2, EsampConfig(beta=0.5, mix="unsharpened"), s)}
    parsed = es.parse_request_settings(extra)
    assert parsed["group"] == "g" and parsed["sample"] == 2 and parsed["beta"] == 0.5
    assert parsed["temperature"] == 0.7 and parsed["top_k"] == 20 and parsed["mix"] == "unsharpened"
    assert es.vllm_filters(True, s) == dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)
    assert es.vllm_filters(True, SamplingConfig(temperature=0.0))["temperature"] == 0.0
    assert es.vllm_filters(False, s)["top_p"] == 0.9
    assert es.parse_request_settings({}) is None
    with pytest.raises(ValueError):
        es.parse_request_settings({es.KEY: {"group": "g", "sample": 0, "mix": "bogus"}})


def test_layers_and_architectures_give_clear_errors():
    assert es.resolve_layer(-1, 30, "target") == 29
    with pytest.raises(ConfigError) as err:
        es.resolve_layer(30, 30, "target")
    assert err.value.hint
    with pytest.raises(ConfigError):
        es.esamp_architecture("GPT2LMHeadModel")


def test_sampler_mask_matches_core_for_single_filters():
    torch.manual_seed(0)
    z = torch.randn(6, 500) * 3
    R = z.shape[0]
    one = lambda v, dt=torch.float32: torch.full((R,), v, dtype=dt)  # noqa: E731
    for k, p, m in ((20, 1.0, 0.0), (0, 1.0, 0.1), (0, 1.0, 0.0)):
        ours = sampler_candidate_mask(z, one(k, torch.long), one(p), one(m))
        core = iv.candidate_mask(z, one(k, torch.long), one(p), one(m))
        assert torch.equal(ours, core), (k, p, m)
    ours = sampler_candidate_mask(z, one(0, torch.long), one(0.9), one(0.0))
    core = iv.candidate_mask(z, one(0, torch.long), one(0.9), one(0.0))
    assert (ours != core).sum() <= R  # top-p alone: at most the boundary token per row
    assert ours.any(dim=-1).all() and ours.gather(1, z.argmax(-1, keepdim=True)).all()


def test_flat_bank_equals_core_bank():
    for optimizer in ("adam", "sgd"):
        a = DistillerBank(16, rank=4, slots=3, optimizer=optimizer, seed=5)
        b = FlatDistillerBank(16, rank=4, slots=3, optimizer=optimizer, seed=5)
        for g in ("p", "q"):
            a.allocate(g), b.allocate(g)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            layout = RowLayout.from_slots([1, 0, 1])
            x, y = torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen)
            want_pred = a.predict(x, layout)
            want_loss = a.train_step(x, y, layout)
            pred, err, loss = b.predict_and_train(x, y, layout)
            assert torch.equal(pred, want_pred) and torch.equal(loss, want_loss)
            assert torch.equal(err, DistillerBank.row_error(want_pred, y))
        a.free("q"), b.free("q")
        for k in a.PARAMS:
            assert torch.equal(a.params[k], b.params[k])


def test_bench_workload_parsing():
    from esamp.bench import parse_workload

    assert parse_workload("16x64") == (16, 1, 64)
    assert parse_workload("32xn8x256") == (32, 8, 256)
    with pytest.raises(ConfigError):
        parse_workload("16by64")
