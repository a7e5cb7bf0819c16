import pytest
import torch

from esamp.core.distiller import DistillerBank, RowLayout
from esamp.errors import BankFullError

H = 32


def _bank(**kw):
    return DistillerBank(H, rank=8, slots=kw.pop("slots", 4), lr=kw.pop("lr", 1e-2), **kw)


def test_layout_places_rows_in_their_slot_blocks():
    lay = RowLayout.from_slots([5, 2, 5, 5, 2])
    assert lay.active.tolist() == [5, 2]
    assert lay.row_slot.tolist() == [0, 1, 0, 0, 1]
    assert lay.row_pos.tolist() == [0, 0, 1, 2, 1]
    assert lay.width == 3


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
        losses.append(float(bank.train_step(x, y, lay)[0]))
    assert sum(losses[-10:]) / 10 < 0.75 * sum(losses[:10]) / 10


def test_groups_never_share_state_and_a_freed_slot_starts_fresh():
    bank = _bank()
    fresh = {k: v.clone() for k, v in bank.params.items()}
    a, b = bank.allocate("a"), bank.allocate("b")
    assert a != b and bank.allocate("a") == a
    x, y = torch.randn(4, H), torch.randn(4, H)
    for _ in range(5):
        bank.train_step(x, y, RowLayout.from_slots([a] * 4))
    for k in bank.params:
        assert not torch.equal(bank.params[k][a], fresh[k][a]) or k == "b"
        assert torch.equal(bank.params[k][b], fresh[k][b]), f"training group a moved group b's {k}"
    assert bank.steps[a] == 5 and bank.steps[b] == 0
    bank.free("a")
    for k in bank.params:
        assert torch.equal(bank.params[k][a], fresh[k][a])
        assert not bank.exp_avg[k][a].any() and not bank.exp_avg_sq[k][a].any()
    assert bank.steps[a] == 0
    assert bank.allocate("c") == a  # the freed slot is handed out again, fresh


def test_two_groups_in_one_step_equal_two_separate_steps():
    x1, y1, x2, y2 = (torch.randn(3, H) for _ in range(4))
    joint, single = _bank(), _bank()
    ja, jb = joint.allocate("a"), joint.allocate("b")
    sa, sb = single.allocate("a"), single.allocate("b")
    joint.train_step(torch.cat([x1, x2]), torch.cat([y1, y2]), RowLayout.from_slots([ja] * 3 + [jb] * 3))
    single.train_step(x1, y1, RowLayout.from_slots([sa] * 3))
    single.train_step(x2, y2, RowLayout.from_slots([sb] * 3))
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


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_update_matches_torch_optimizers_per_slot(optimizer):
    """Each slot steps exactly like its own torch optimizer, whether its rows are read in place
    (consecutive slots) or gathered (scattered slots)."""
    H, r = 12, 3
    for slots in ([0, 1], [2, 0], [1]):
        bank = DistillerBank(H, rank=r, slots=3, optimizer=optimizer, lr=1e-2, seed=4)
        ref = {s: bank.flat[s].clone().requires_grad_(True) for s in set(slots)}
        opt = {s: (torch.optim.Adam([ref[s]], lr=1e-2) if optimizer == "adam"
                   else torch.optim.SGD([ref[s]], lr=1e-2)) for s in ref}
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            rows = [s for s in slots for _ in range(2)]
            layout = RowLayout.from_slots(rows)
            x, y = torch.randn(len(rows), H, generator=gen), torch.randn(len(rows), H, generator=gen)
            for s in ref:
                p = {k: bank._view(ref[s].unsqueeze(0), k) for k in bank.PARAMS}
                own = [i for i, t in enumerate(rows) if t == s]
                one = RowLayout.from_slots([0] * len(own))
                loss = bank.row_error(bank._forward(x[own], one, p), y[own]).mean()
                opt[s].zero_grad()
                loss.backward()
                opt[s].step()
            bank.train_step(x, y, layout)
            for s in ref:
                torch.testing.assert_close(bank.flat[s], ref[s].detach(), rtol=1e-5, atol=1e-6)


def test_the_lowest_free_slot_goes_first_so_groups_started_together_are_consecutive():
    bank = _bank(slots=4)
    assert [bank.allocate(g) for g in "abc"] == [0, 1, 2]
    bank.free("b")
    bank.free("a")
    assert [bank.allocate(g) for g in "de"] == [0, 1]
    assert RowLayout.from_slots([0, 0, 1, 2]).span == (0, 3)
    assert RowLayout.from_slots([1, 0]).span is None
