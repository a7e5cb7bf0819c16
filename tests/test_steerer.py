"""The steering step: plans built from settings, and the reference path equal to the core's functions."""

from __future__ import annotations

import pytest
import torch

from esamp.core import intervention as iv
from esamp.core.config import Filters, Steering
from esamp.core.distiller import DistillerBank
from esamp.core.steerer import SteeredRow, Steerer, StepPlan

H, V = 16, 300


def test_plan_carries_each_rows_settings():
    rows = [SteeredRow(0, Steering(beta=0.5, mix="paper"), Filters(temperature=0.0, top_k=5)),
            SteeredRow(0, Steering(beta=0.5, mix="paper"), Filters()),
            SteeredRow(2, Steering(beta=1.0, mix="unsharpened", train_rows="group"), Filters(min_p=0.0)),
            SteeredRow(2, Steering(beta=1.0, mix="unsharpened", train_rows="group"), Filters())]
    plan = StepPlan.build(rows, vocab=V)
    assert plan.temperature.flatten().tolist() == pytest.approx([1.0, 0.8, 0.8, 0.8])  # greedy: 1
    assert plan.a.flatten().tolist() == [1.5, 1.5, 1.0, 1.0] and plan.b.flatten().tolist() == [0.5, 0.5, 1.0, 1.0]
    assert plan.top_k.tolist() == [5, 0, 0, 0] and plan.top_k_or_vocab.tolist() == [5, V, V, V]
    assert plan.key == hash(((0, 0, 2, 2), (True, True, True, False)))  # "group": one row of slot 2 trains
    assert plan.layout.slots == (0, 2)


def test_no_training_plan_and_filter_only_plan():
    rows = [SteeredRow(1, Steering(train=False), Filters())] * 3
    assert StepPlan.build(rows).training is None
    plain = StepPlan.build(rows, distill=False)
    assert plain.layout is None and plain.training is None


def test_reference_steerer_equals_the_core_functions():
    torch.manual_seed(0)
    bank = DistillerBank(H, rank=4, slots=2, seed=1)
    bank.allocate("g")
    steerer = Steerer(bank)
    rows = [SteeredRow(0, Steering(beta=0.8), Filters(top_k=30, top_p=0.9, min_p=0.05))] * 3
    plan = StepPlan.build(rows, vocab=V)
    x, y, z = torch.randn(3, H), torch.randn(3, H), torch.randn(3, V) * 3
    W = torch.randn(V, H)
    want_pred = bank.predict(x, plan.layout)
    pred, err, loss = steerer.distill(plan, x, y)
    torch.testing.assert_close(pred, want_pred)
    scaled = steerer.filter(plan, z.clone())
    mask = iv.candidate_mask(z / 0.8, torch.full((3,), 30), torch.full((3,), 0.9), torch.full((3,), 0.05))
    assert torch.equal(torch.isfinite(scaled), mask)
    d = pred @ W.T
    full, counts = steerer.mix(plan, scaled.clone(), d)
    at, counts_at = steerer.mix_at_candidates(plan, scaled.clone(), pred, W)
    want = iv.steer(z / 0.8, mask, pred, W, plan.a, plan.b)
    torch.testing.assert_close(full, want)
    torch.testing.assert_close(at, want)
    assert torch.equal(counts, mask.sum(-1)) and torch.equal(counts_at, mask.sum(-1))
