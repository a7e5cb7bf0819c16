"""The shared Distiller (``distiller="shared"``): one Distiller that every group uses and trains,
kept across groups, with the slot accounting of a bank."""

from __future__ import annotations

import pytest
import torch

from esamp.core.config import EsampConfig, Filters, Steering
from esamp.core.distiller import SHARED_SLOT, DistillerBank, RowLayout, SlotLedger, bank_for, ledger_for
from esamp.core.steerer import PlanBuffers, SteeredRow, Steerer, StepPlan
from esamp.errors import BankFullError

H = 32


def _shared(**kw) -> DistillerBank:
    return DistillerBank(H, rank=8, slots=kw.pop("slots", 3), lr=kw.pop("lr", 1e-2), shared=True, **kw)


def _rows(groups: list[str], **steering) -> list[SteeredRow]:
    """One steered row per entry of ``groups``, all on the shared slot."""
    return [SteeredRow(SHARED_SLOT, Steering(**steering), Filters(), group=g) for g in groups]


def test_every_group_holds_the_one_slot_and_slots_still_count_groups():
    ledger = SlotLedger(2, shared=True)
    assert ledger.distillers == 1 and ledger.scratch == 1  # one Distiller, then the padding slot
    assert [ledger.allocate(g) for g in ("a", "b", "a")] == [SHARED_SLOT] * 3
    assert ledger.groups == {"a": SHARED_SLOT, "b": SHARED_SLOT} and ledger.free_slots == 0
    with pytest.raises(BankFullError) as info:
        ledger.allocate("c")
    assert "shared Distiller" in str(info.value) and "2 prompt groups" in str(info.value)
    assert "--slots" in info.value.hint
    assert ledger.free("a") == SHARED_SLOT and ledger.free("a") is None and ledger.free_slots == 1
    assert ledger.allocate("c") == SHARED_SLOT and set(ledger.groups) == {"b", "c"}


def test_the_settings_choose_the_bank_or_the_shared_distiller():
    assert EsampConfig().distiller == "bank" and not EsampConfig().shared_distiller
    shared = EsampConfig(distiller="shared", slots=5, rank=4)
    bank = bank_for(shared, H)
    assert bank.shared and bank.capacity == 5 and bank.rank == 4
    assert bank.store.flat.shape[0] == 2  # the shared Distiller and the scratch slot, whatever --slots says
    assert bank_for(EsampConfig(slots=5, rank=4), H).store.flat.shape[0] == 6
    follower = ledger_for(shared)
    assert type(follower) is SlotLedger and follower.shared and follower.scratch == bank.scratch


def test_a_bad_mode_names_the_setting_and_the_choices():
    from esamp.core.config import make_config
    from esamp.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        make_config(EsampConfig, {"distiller": "--distiller"}, distiller="tllm")
    assert "--distiller='tllm'" in str(info.value) and "one of bank, shared" in str(info.value)
    assert info.value.hint


def test_the_shared_distiller_starts_as_a_banks_first_slot():
    """A group alone on a fresh engine gets the same Distiller in both modes."""
    shared, bank = _shared(seed=3), DistillerBank(H, rank=8, slots=3, seed=3)
    for name in DistillerBank.PARAMS:
        assert torch.equal(shared.params[name][SHARED_SLOT], bank.params[name][0])


def test_one_step_trains_on_every_groups_rows_with_the_mean_loss():
    """Rows of two groups on the shared slot are one unit: ŷ and e come from the weights before the
    step, the loss is the mean over every training row, and the update is one optimizer step on
    that mean (the same as one group holding all the rows)."""
    torch.manual_seed(0)
    x, y = torch.randn(5, H), torch.randn(5, H)
    shared, one = _shared(), _shared()
    for g in ("a", "b"):
        shared.allocate(g)
    one.allocate("only")
    plan = StepPlan.build(_rows(["a", "b", "a", "b", "b"], train_rows="all"))
    assert plan.layout.shape == (1, 5) and plan.layout.slots == (SHARED_SLOT,) and plan.trains == (True,) * 5
    before = shared.predict(x, plan.layout)
    prediction, errors, loss = shared.step(x, y, plan.layout)
    torch.testing.assert_close(prediction, before)
    torch.testing.assert_close(loss, errors.mean().reshape(1))
    _, _, want = one.step(x, y, RowLayout.from_slots([SHARED_SLOT] * 5))
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(shared.store.flat, one.store.flat)
    assert shared.store.steps[SHARED_SLOT] == 1 and not shared.store.steps[shared.scratch]


def test_train_rows_group_trains_one_row_per_group_not_one_per_slot():
    rows = _rows(["a", "a", "b", "a", "b", "c"])
    plan = StepPlan.build(rows)
    assert plan.trains == (True, False, True, False, False, True)  # each group's first row
    assert plan.layout.weight.tolist() == [1, 0, 1, 0, 0, 1]
    held_back = StepPlan.build(
        rows[:2]
        + [SteeredRow(SHARED_SLOT, Steering(), Filters(), may_train=False, group="b")]
        + _rows(["c"], train=False)
    )
    assert held_back.trains == (True, False, False, False)
    # without a group name a slot's rows are one group, as in a bank (the default is unchanged)
    assert StepPlan.build([SteeredRow(SHARED_SLOT, Steering(), Filters())] * 3).trains == (True, False, False)


def test_a_group_that_ends_leaves_its_weights_to_the_next_unlike_a_bank():
    """The shared Distiller is never re-initialised while the engine runs: the next group starts
    from the weights the last one left, with its optimizer state; a bank's slot starts fresh."""
    torch.manual_seed(1)
    x, y = torch.randn(4, H), torch.randn(4, H)
    for shared in (True, False):
        bank = DistillerBank(H, rank=8, slots=2, lr=1e-2, shared=shared)
        fresh = bank.store.flat.clone()
        slot = bank.allocate("first")
        for _ in range(3):
            bank.step(x, y, RowLayout.from_slots([slot] * 4))
        trained = bank.store.flat.clone()
        assert bank.free("first") == slot
        assert bank.allocate("second") == slot
        if shared:
            assert torch.equal(bank.store.flat, trained) and bank.store.steps[slot] == 3
            assert bank.store.flat_m[slot].any()
        else:
            assert torch.equal(bank.store.flat[slot], fresh[slot]) and bank.store.steps[slot] == 0


def test_the_shared_loss_falls_across_groups():
    """Groups that decode the same kind of rows one after another: each starts where the last left,
    so the first loss of every later group is lower than the first group's."""
    torch.manual_seed(0)
    mix = torch.randn(H, H) / H**0.5
    bank = _shared()
    firsts = []
    for group in range(4):
        slot = bank.allocate(f"g{group}")
        plan = StepPlan.build(_rows([f"g{group}"] * 8, train_rows="all"))
        for step in range(40):
            x = torch.randn(8, H)
            y = torch.nn.functional.layer_norm(x + torch.tanh(x @ mix), (H,))
            loss = bank.step(x, y, plan.layout)[2]
            if step == 0:
                firsts.append(float(loss))
        assert slot == SHARED_SLOT
        bank.free(f"g{group}")
    assert firsts[1] < 0.8 * firsts[0] and firsts[3] < firsts[1]


def test_a_fixed_shape_shared_plan_steps_like_the_tight_one():
    """On the engine's buffers (one unit as wide as the batch, padded to a bucket) the shared step
    gives the tight plan's ŷ, e and loss."""
    torch.manual_seed(2)
    banks = [_shared(), _shared()]
    rows = _rows(["a", "b", "b", "a", "c"])
    x, y = torch.randn(5, H), torch.randn(5, H)
    want = Steerer(banks[0]).distill(StepPlan.build(rows), x, y)
    buffers = PlanBuffers(rows=16, units=1, width=16, device=torch.device("cpu"), scratch=banks[1].scratch)
    fixed = StepPlan.build(rows, index=[0, 1, 2, 3, 4], buffers=buffers)
    assert fixed.layout.shape == (1, 8)
    taps_x, taps_y = torch.zeros(17, H), torch.zeros(17, H)
    taps_x[:5], taps_y[:5] = x, y
    got = Steerer(banks[1]).distill(fixed, taps_x, taps_y)
    torch.testing.assert_close(got[0][:5], want[0])
    torch.testing.assert_close(got[1][:5], want[1])
    torch.testing.assert_close(got[2], want[2])
    torch.testing.assert_close(banks[1].store.flat, banks[0].store.flat)
