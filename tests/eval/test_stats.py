import pytest

from esamp.eval.stats import paired_bootstrap


def test_constant_shift_has_a_point_interval():
    d = paired_bootstrap([0.1, 0.5, 0.9], [0.2, 0.6, 1.0], resamples=500)
    assert d.delta == pytest.approx(0.1)
    assert d.low == pytest.approx(0.1) and d.high == pytest.approx(0.1)
    assert d.problems == 3


def test_interval_holds_the_mean_and_is_reproducible():
    a = [0, 1, 0, 1, 1, 0, 0, 1]
    b = [1, 1, 0, 1, 0, 1, 1, 1]
    d1 = paired_bootstrap(a, b, seed=3)
    d2 = paired_bootstrap(a, b, seed=3)
    assert d1 == d2
    assert d1.low <= d1.delta <= d1.high
    assert d1.delta == pytest.approx(0.25)
    assert d1.low < 0.25 < d1.high


def test_pairing_cancels_shared_difficulty():
    # Problems differ wildly, the arms differ by a tiny constant: the interval is tight.
    a = [0.0, 1.0, 0.0, 1.0]
    b = [0.01, 1.01, 0.01, 1.01]
    d = paired_bootstrap(a, b, resamples=200)
    assert d.high - d.low < 1e-9


def test_mismatched_lengths():
    with pytest.raises(ValueError):
        paired_bootstrap([1, 2], [1])
