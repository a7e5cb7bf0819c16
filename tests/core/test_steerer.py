"""The steering step: plans built from settings, fixed-address plans, and the reference path
equal to the core's functions."""

from __future__ import annotations

import pytest
import torch

from esamp.core import intervention as iv
from esamp.core.config import Filters, Steering
from esamp.core.distiller import DistillerBank
from esamp.core.steerer import PlanBuffers, SteeredRow, Steerer, StepPlan, bucket

H, V = 16, 300


def test_plan_carries_each_rows_settings():
    rows = [
        SteeredRow(0, Steering(beta=0.5, mix="paper", train_rows="all"), Filters(temperature=0.0, top_k=5)),
        SteeredRow(0, Steering(beta=0.5, mix="paper", train_rows="all"), Filters()),
        SteeredRow(2, Steering(beta=1.0, mix="unsharpened", train_rows="group"), Filters(min_p=0.0)),
        SteeredRow(2, Steering(beta=1.0, mix="unsharpened", train_rows="group"), Filters()),
        SteeredRow(-1, Steering(beta=1.0), Filters(top_p=0.5)),
    ]  # only filtered
    plan = StepPlan.build(rows, steered=4)
    assert plan.temperature.tolist() == pytest.approx([1.0, 0.8, 0.8, 0.8, 0.8])  # greedy: 1
    assert plan.a.tolist() == [1.5, 1.5, 1.0, 1.0, 1.0] and plan.b.tolist() == [0.5, 0.5, 1.0, 1.0, 0.0]
    assert plan.top_k.tolist() == [5, 0, 0, 0, 0]
    assert plan.min_p.tolist() == pytest.approx([0.1, 0.1, 0.0, 0.1, 0.1])
    assert plan.layout.slots == (0, 2) and plan.layout.shape == (2, 2)
    # "group": one row of slot 2 trains
    assert plan.layout.weight.tolist() == [1, 1, 1, 0] and plan.key == ((2, 2), True)


def test_a_plan_on_buffers_reuses_each_rows_numbers_only_while_they_hold():
    """Rebuilt on the same buffers, a plan works out each row object's numbers once; the same
    object steered in one plan and only filtered in the next gets the filtered numbers, and a row
    object given twice in one plan counts twice."""
    buffers = PlanBuffers(rows=8, units=4, width=4, device=torch.device("cpu"), scratch=9)
    a = SteeredRow(0, Steering(beta=0.5, mix="paper"), Filters(temperature=0.5, min_p=0.2))
    b = SteeredRow(1, Steering(beta=1.0, mix="unsharpened"), Filters(top_p=0.9))
    first = StepPlan.build([a, b, b], steered=3, index=[0, 1, 2], buffers=buffers)
    assert first.a.tolist() == [1.5, 1.0, 1.0] and first.b.tolist() == [0.5, 1.0, 1.0]
    assert (
        first.temperature.tolist() == pytest.approx([0.5, 0.8, 0.8])
        and first.top_p.tolist()[1:] == [pytest.approx(0.9)] * 2
    )
    assert set(buffers.row_values) == {id(a), id(b)}
    second = StepPlan.build([b, a], steered=1, index=[0, 1], buffers=buffers)  # a only filtered now
    assert second.a.tolist() == [1.0, 1.0] and second.b.tolist() == [1.0, 0.0]
    assert second.min_p.tolist() == pytest.approx([0.1, 0.2])
    fresh = StepPlan.build([b, a], steered=1)  # no buffers: nothing kept
    assert fresh.a.tolist() == second.a.tolist() and fresh.b.tolist() == second.b.tolist()


def test_no_training_plan_and_filter_only_plan():
    rows = [SteeredRow(1, Steering(train=False), Filters())] * 3
    assert StepPlan.build(rows).layout.training == ()
    plain = StepPlan.build(rows, steered=0)
    assert plain.layout is None and plain.steered == 0 and plain.b.tolist() == [0.0] * 3


def test_plans_on_buffers_keep_their_addresses_and_pad_to_buckets():
    """Two different batches of one bucketed shape give plans whose tensors sit at the same
    addresses (a captured step reads them there); the block is padded with the scratch slot."""
    buffers = PlanBuffers(rows=16, units=8, width=4, device=torch.device("cpu"), scratch=9)
    one = StepPlan.build([SteeredRow(s, Steering(), Filters()) for s in (3, 3, 5)], index=[0, 2, 1], buffers=buffers)
    assert one.layout.shape == (2, 2) and one.layout.units.tolist() == [3, 5]
    ptrs = [t.data_ptr() for t in (one.layout.units, one.layout.gather, one.layout.cell, one.layout.weight, one.a)]
    two = StepPlan.build(
        [SteeredRow(s, Steering(beta=2.0), Filters()) for s in (0, 7, 7)], index=[1, 0, 2], buffers=buffers
    )
    assert [
        t.data_ptr() for t in (two.layout.units, two.layout.gather, two.layout.cell, two.layout.weight, two.a)
    ] == ptrs
    assert two.layout.units.tolist() == [0, 7] and two.a.tolist() == [3.0] * 3 and two.index.tolist() == [1, 0, 2]
    three = StepPlan.build([SteeredRow(s, Steering(), Filters()) for s in (0, 1, 2)], index=[0, 1, 2], buffers=buffers)
    assert three.layout.shape == (4, 1) and three.layout.units.tolist() == [0, 1, 2, 9]
    assert three.layout.gather.tolist() == [0, 1, 2, 16]  # padding reads the zero row
    assert [bucket(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    shapes = [p.layout.shape for p in StepPlan.shapes(buffers, 8)]
    assert shapes == [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)]


def test_a_plan_on_buffers_steps_like_a_plain_plan():
    """Padded, fixed-address plans give the Distiller step and the filter-and-mix of plain plans."""
    torch.manual_seed(0)
    banks = [DistillerBank(H, rank=4, slots=4, seed=1) for _ in range(2)]
    for bank in banks:
        bank.allocate("g"), bank.allocate("h")
    rows = [SteeredRow(s, Steering(beta=0.8), Filters()) for s in (0, 1, 1)]
    plain = StepPlan.build(rows)
    buffers = PlanBuffers(rows=8, units=4, width=4, device=torch.device("cpu"), scratch=banks[1].scratch)
    fixed = StepPlan.build(rows, index=[0, 1, 2], buffers=buffers)
    x, y = torch.randn(3, H), torch.randn(3, H)
    want = Steerer(banks[0]).distill(plain, x, y)
    taps_x, taps_y = torch.zeros(9, H), torch.zeros(9, H)
    taps_x[:3], taps_y[:3] = x, y
    got = Steerer(banks[1]).distill(fixed, taps_x, taps_y)
    torch.testing.assert_close(got[0][:3], want[0])
    torch.testing.assert_close(got[1][:3], want[1])
    torch.testing.assert_close(got[2][:2], want[2])


def test_reference_steerer_equals_the_core_functions():
    torch.manual_seed(0)
    bank = DistillerBank(H, rank=4, slots=2, seed=1)
    bank.allocate("g")
    steerer = Steerer(bank)
    rows = [SteeredRow(0, Steering(beta=0.8), Filters(top_k=30, top_p=0.9, min_p=0.05))] * 3
    plan = StepPlan.build(rows)
    x, y, z = torch.randn(3, H), torch.randn(3, H), torch.randn(3, V) * 3
    W = torch.randn(V, H)
    want_pred = bank.predict(x, plan.layout)
    pred, err, loss = steerer.distill(plan, x, y)
    torch.testing.assert_close(pred, want_pred)
    scaled = steerer.filter(plan, z.clone())
    mask = iv.candidate_mask(z / 0.8, torch.full((3,), 30), torch.full((3,), 0.9), torch.full((3,), 0.05))
    assert torch.equal(torch.isfinite(scaled), mask)
    d = pred @ W.T
    full, counts = steerer.mix_dense(plan, scaled.clone(), d)
    at, counts_at = steerer.mix_at_candidates(plan, scaled.clone(), pred, W)
    a, b = plan.a.reshape(-1, 1), plan.b.reshape(-1, 1)
    want = iv.steer(z / 0.8, mask, pred, W, a, b)
    torch.testing.assert_close(full, want)
    torch.testing.assert_close(at, want)
    assert torch.equal(counts, mask.sum(-1)) and torch.equal(counts_at, mask.sum(-1))
    # the engine path: rows picked from a bigger batch, filtered and mixed in place
    batch = torch.randn(5, V)
    batch[[3, 1, 4]] = z
    fixed = StepPlan.build(rows, index=[3, 1, 4])
    got_counts = steerer.filter_and_mix(fixed, batch, d)
    torch.testing.assert_close(batch[[3, 1, 4]], want)
    assert got_counts.tolist() == mask.sum(-1).tolist()


def test_entropy_matched_rows_take_the_pytorch_path_on_every_backend():
    """A plan with rows of the matched mix: the reference step, the dense mix and the engine's
    filter-and-mix (which leaves the fused kernel for it) all give the core's matched mix."""
    torch.manual_seed(0)
    bank = DistillerBank(H, rank=4, slots=2, seed=1)
    bank.allocate("g")
    steerer = Steerer(bank)
    rows = [
        SteeredRow(0, Steering(beta=0.8, mix="matched"), Filters(top_p=0.9, min_p=0.02)),
        SteeredRow(0, Steering(beta=0.8, mix="paper"), Filters(top_p=0.9, min_p=0.02)),
        SteeredRow(0, Steering(beta=0.8, mix="matched"), Filters(top_p=0.9, min_p=0.02)),
    ]
    plan = StepPlan.build(rows)
    assert plan.matched.tolist() == [1.0, 0.0, 1.0] and plan.mix_key == (False, True, True)
    assert StepPlan.build(rows[1:2]).matched is None and StepPlan.build(rows[1:2]).mix_key == (False, False, True)
    x, z, W = torch.randn(3, H), torch.randn(3, V) * 3, torch.randn(V, H)
    pred = bank.predict(x, plan.layout)
    scaled = steerer.filter(plan, z.clone())
    mask = torch.isfinite(scaled)
    a, b = plan.a.reshape(-1, 1), plan.b.reshape(-1, 1)
    want = iv.steer(z / 0.8, mask, pred, W, a, b, matched=torch.tensor([[True], [False], [True]]))
    plain = iv.filtered_logits(z / 0.8, mask)
    torch.testing.assert_close(
        iv.candidate_entropy(want[[0, 2]]), iv.candidate_entropy(plain[[0, 2]]), atol=1e-5, rtol=0
    )
    at, _ = steerer.mix_at_candidates(plan, scaled.clone(), pred, W)
    torch.testing.assert_close(at, want)
    full, _ = steerer.mix_dense(plan, scaled.clone(), pred @ W.T)
    torch.testing.assert_close(full, want)
    buffers = PlanBuffers(rows=8, units=4, width=4, device=torch.device("cpu"), scratch=bank.scratch)
    fixed = StepPlan.build(rows, index=[3, 1, 4], buffers=buffers)
    assert fixed.matched.tolist() == [1.0, 0.0, 1.0]
    address = fixed.matched.data_ptr()
    batch = torch.randn(5, V)
    batch[[3, 1, 4]] = z
    steerer.filter_and_mix(fixed, batch, pred @ W.T)
    torch.testing.assert_close(batch[[3, 1, 4]], want)
    again = StepPlan.build(rows[::-1], index=[0, 1, 2], buffers=buffers)  # a captured step reads it there
    assert again.matched.data_ptr() == address
    assert StepPlan.build(rows[1:2], index=[0], buffers=buffers).matched is None  # idle: none matched


class _Beside:
    """A side stream that runs what it is given at once and names it (no GPU)."""

    def __init__(self):
        self.runs = []

    def run(self, key, fn, *inputs, graphed=True):
        self.runs.append(key)
        fn(*inputs)
        return "event"


def test_auto_runs_the_update_in_line_for_small_blocks_and_beside_for_large():
    """``inline_cells`` (ESAMP_UPDATE=auto): a block of at most that many cells takes its update in
    the Distiller step's call, a larger one beside it; without it every update goes beside, and
    without a side stream every update is in line. Either way the same parameters come out."""

    def plan_of(units: int, width: int) -> StepPlan:
        return StepPlan.build([SteeredRow(u, Steering(), Filters()) for u in range(units) for _ in range(width)])

    small, large = plan_of(2, 1), plan_of(2, 3)  # 2 and 6 cells
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, H, generator=gen), torch.randn(6, H, generator=gen)
    outcomes = []
    for beside, cells in ((None, 0), (_Beside(), 0), (_Beside(), 2)):
        bank = DistillerBank(H, rank=4, slots=2, device="cpu", seed=1)
        bank.updating = lambda event: None  # (a GPU's update in flight; settle then has nothing to wait for)
        steerer = Steerer(bank, beside=beside, inline_cells=cells)
        assert steerer.beside_for(small) is (beside if cells < 2 else None)
        assert steerer.beside_for(large) is beside
        for plan in (small, large):
            steerer.distill(plan, x[: plan.rows], y[: plan.rows])
        if beside is not None:
            assert [key[0] for key in beside.runs] == (["learn"] if cells else ["learn", "learn"])
        outcomes.append(bank.store.flat.clone())
    assert torch.equal(outcomes[0], outcomes[1]) and torch.equal(outcomes[0], outcomes[2])
