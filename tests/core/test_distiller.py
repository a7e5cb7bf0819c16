import pytest
import torch

from esamp.core.distiller import DistillerBank, HostLayout, RowLayout, block_shape, split_for
from esamp.errors import BankFullError


def train_step(bank, x, y, layout):
    """One optimizer step on the layout's training units: their losses (before the step)."""
    return bank.step(x, y, layout)[2][list(layout.training)]


H = 32


def _bank(**kw):
    return DistillerBank(H, rank=8, slots=kw.pop("slots", 4), lr=kw.pop("lr", 1e-2), **kw)


def test_layout_places_rows_in_their_slot_blocks():
    lay = RowLayout.from_slots([5, 2, 5, 5, 2])
    assert lay.units.tolist() == [5, 2] and lay.slots == (5, 2) and lay.shape == (2, 3)
    assert lay.gather.tolist() == [0, 2, 3, 1, 4, 5]  # cell (u, w) reads row gather[u·W + w]; 5: the zero row
    assert lay.cell.tolist() == [0, 3, 1, 2, 4]
    assert lay.weight.tolist() == [1, 1, 1, 1, 1, 0] and lay.training == (0, 1)


@pytest.mark.parametrize("slots", [[5, 2, 5, 5, 2], [3], [1, 1, 1, 1], [4, 3, 2, 1, 4]])
def test_the_host_layout_is_the_layout_and_block_shape_its_tight_shape(slots):
    """A plan on fixed buffers writes ``HostLayout``'s lists where ``RowLayout.from_slots`` would
    make tensors: the same fields, padded or not; ``block_shape`` is the tight layout's shape."""
    trains = [i % 2 == 0 for i in range(len(slots))]
    assert block_shape(slots) == RowLayout.from_slots(slots).shape
    for pad in ({}, dict(units=8, width=4, scratch=9, zero_row=30, sources=[7 * i for i in range(len(slots))])):
        host, lay = HostLayout.of(slots, trains, **pad), RowLayout.from_slots(slots, trains, **pad)
        assert host.units == lay.units.tolist() and host.gather == lay.gather.tolist()
        assert host.cell == lay.cell.tolist() and host.row_of == lay.row_of.tolist()
        assert host.weight == lay.weight.tolist() and (host.width, host.zero_row) == (lay.width, lay.zero_row)
        assert (host.slots, host.training) == (lay.slots, lay.training)


def test_a_padded_layout_steps_exactly_like_the_tight_one():
    """Padding the block (more units on the scratch slot, wider rows on the zero row) changes no
    prediction, error, loss or parameter beyond rounding: what lets one captured step serve many
    batches."""
    x, y = torch.randn(5, H), torch.randn(5, H)
    tight, padded = _bank(), _bank()
    for bank in (tight, padded):
        bank.allocate("a"), bank.allocate("b")
    slots = [1, 0, 1, 1, 0]
    a = tight.step(x, y, RowLayout.from_slots(slots))
    lay = RowLayout.from_slots(slots, units=4, width=4, scratch=padded.scratch)
    b = padded.step(x, y, lay)
    torch.testing.assert_close(b[0][:5], a[0])
    torch.testing.assert_close(b[1][:5], a[1])
    torch.testing.assert_close(b[2][:2], a[2])
    assert not b[2][2:].any()
    torch.testing.assert_close(padded.store.flat, tight.store.flat)  # (other GEMM shapes: rounding)
    assert torch.equal(tight.store.steps, padded.store.steps)


def test_x_ag_split_over_pieces_of_h_steps_like_one_long_product():
    """The GPU's split of x·[A|G] over pieces of H (``split_for``) changes no prediction, error,
    loss or parameter beyond rounding, through several optimizer steps of two slots (Adam's
    step divides by the root of a small second moment, so a last-bit difference in a gradient can
    move a weight by a few 1e-5)."""
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(7, H, generator=gen), torch.randn(7, H, generator=gen)
    slots = [0, 1, 1, 0, 1, 0, 0]
    banks = [_bank(split=k) for k in (1, 4)]
    for _ in range(3):
        one, split = (bank.step(x, y, RowLayout.from_slots(slots)) for bank in banks)
        for a, b in zip(one, split):
            torch.testing.assert_close(b, a)
    torch.testing.assert_close(banks[1].store.flat, banks[0].store.flat, rtol=1e-3, atol=1e-4)
    with pytest.raises(ValueError, match="does not divide"):
        _bank(split=5)


def test_h_is_split_on_a_gpu_only_and_into_pieces_no_shorter_than_its_floor():
    assert split_for(3584, "cpu") == 1
    assert [split_for(h, "cuda") for h in (3584, 896, 576, 4096, 1536)] == [8, 2, 1, 8, 4]


def test_predict_shapes_and_layer_norm_output():
    bank = _bank()
    slot = bank.allocate("g")
    x = torch.randn(6, H)
    y = bank.predict(x, RowLayout.from_slots([slot] * 6))
    assert y.shape == (6, H) and y.dtype == torch.float32
    # LayerNorm with affine (1, 0) at init: every row has mean 0 and unit variance
    torch.testing.assert_close(y.mean(-1), torch.zeros(6), atol=1e-5, rtol=0)
    assert DistillerBank.row_error(y, torch.zeros(6, H)).shape == (6,)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_loss_falls_on_a_fixed_shallow_to_deep_mapping(optimizer):
    torch.manual_seed(0)
    mix = torch.randn(H, H) / H**0.5
    bank = _bank(optimizer=optimizer, lr=1e-2 if optimizer == "adam" else 0.5)
    slot = bank.allocate("g")
    lay = RowLayout.from_slots([slot] * 16)
    losses = []
    for _ in range(150):
        x = torch.randn(16, H)
        y = torch.nn.functional.layer_norm(x + torch.tanh(x @ mix), (H,))
        losses.append(float(train_step(bank, x, y, lay)[0]))
    assert sum(losses[-10:]) / 10 < 0.75 * sum(losses[:10]) / 10


def test_groups_never_share_state_and_a_freed_slot_starts_fresh():
    bank = _bank()
    fresh = {k: v.clone() for k, v in bank.params.items()}
    a, b = bank.allocate("a"), bank.allocate("b")
    assert a != b and bank.allocate("a") == a
    x, y = torch.randn(4, H), torch.randn(4, H)
    for _ in range(5):
        train_step(bank, x, y, RowLayout.from_slots([a] * 4))
    for k in bank.params:
        assert not torch.equal(bank.params[k][a], fresh[k][a]) or k == "b"
        assert torch.equal(bank.params[k][b], fresh[k][b]), f"training group a moved group b's {k}"
    assert bank.store.steps[a] == 5 and bank.store.steps[b] == 0
    bank.free("a")
    for k in bank.params:
        assert torch.equal(bank.params[k][a], fresh[k][a])
        if k in bank.store.exp_avg:
            assert not bank.store.exp_avg[k][a].any() and not bank.store.exp_avg_sq[k][a].any()
    assert bank.store.steps[a] == 0
    assert bank.allocate("c") == a  # the freed slot is handed out again, fresh


def test_two_groups_in_one_step_equal_two_separate_steps():
    x1, y1, x2, y2 = (torch.randn(3, H) for _ in range(4))
    joint, single = _bank(), _bank()
    ja, jb = joint.allocate("a"), joint.allocate("b")
    sa, sb = single.allocate("a"), single.allocate("b")
    train_step(joint, torch.cat([x1, x2]), torch.cat([y1, y2]), RowLayout.from_slots([ja] * 3 + [jb] * 3))
    train_step(single, x1, y1, RowLayout.from_slots([sa] * 3))
    train_step(single, x2, y2, RowLayout.from_slots([sb] * 3))
    for k in joint.params:
        torch.testing.assert_close(joint.params[k], single.params[k])


def test_a_full_bank_is_a_clear_error_not_a_reuse():
    bank = _bank(slots=2)
    bank.allocate("a")
    bank.allocate("b")
    with pytest.raises(BankFullError) as info:
        bank.allocate("c")
    assert "2 Distiller slots" in str(info.value) and info.value.hint
    assert bank.groups == {"a": 0, "b": 1}
    bank.free("a")
    assert bank.allocate("c") == 0


def test_predictions_are_deterministic_per_seed():
    x = torch.randn(2, H)
    p1 = _bank(seed=3).predict(x, RowLayout.from_slots([0, 0]))
    p2 = _bank(seed=3).predict(x, RowLayout.from_slots([0, 0]))
    p3 = _bank(seed=4).predict(x, RowLayout.from_slots([0, 0]))
    assert torch.equal(p1, p2) and not torch.equal(p1, p3)


def test_the_lowest_free_slot_goes_first_so_groups_started_together_are_consecutive():
    bank = _bank(slots=4)
    assert [bank.allocate(g) for g in "abc"] == [0, 1, 2]
    bank.free("b")
    bank.free("a")
    assert [bank.allocate(g) for g in "de"] == [0, 1]
    assert bank.scratch == 4 and bank.scratch not in bank.groups.values()


def test_train_rows_group_trains_on_the_chosen_rows_only():
    """A step that trains on one row per group equals a step on those rows alone, and still
    predicts every row."""
    x, y = torch.randn(6, H), torch.randn(6, H)
    slots = [0, 0, 0, 1, 1, 1]
    trains = [True, False, False, True, False, False]
    masked, alone = _bank(), _bank()
    for bank in (masked, alone):
        bank.allocate("a"), bank.allocate("b")
    pred, err, loss = masked.step(x, y, RowLayout.from_slots(slots, trains))
    keep = [0, 3]
    train_step(alone, x[keep], y[keep], RowLayout.from_slots([0, 1]))
    for k in DistillerBank.PARAMS:
        torch.testing.assert_close(masked.params[k], alone.params[k])
    assert pred.shape == (6, H) and err.shape == (6,)
    torch.testing.assert_close(loss, err[keep])


def test_only_training_slots_step():
    """A slot whose rows do not train (its group has training off) is not touched; its unit
    reports a loss of 0."""
    bank = _bank()
    bank.allocate("a"), bank.allocate("b")
    before = bank.store.flat.clone()
    slots, trains = [0, 1, 1], [False, True, True]
    layout = RowLayout.from_slots(slots, trains)
    _, _, loss = bank.step(torch.randn(3, H), torch.randn(3, H), layout)
    assert loss.shape == (2,) and layout.training == (1,) and loss[0] == 0 and loss[1] > 0
    assert torch.equal(bank.store.flat[0], before[0]) and not torch.equal(bank.store.flat[1], before[1])
    assert bank.store.steps.tolist()[:2] == [0, 1]
