from math import comb

import pytest

from esamp.errors import ConfigError
from esamp.eval.passk import parse_ks, pass_at_k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (8, 2, 1, 0.25),  # pass@1 is the share correct
        (8, 2, 4, 1 - 15 / 70),  # 1 - C(6,4)/C(8,4)
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (8, 0, 1, 0.0),  # c = 0: never
        (8, 0, 8, 0.0),
        (8, 8, 1, 1.0),  # c = n: always
        (8, 1, 8, 1.0),  # k = n: any correct sample counts
        (8, 7, 2, 1.0),  # n - c < k: every draw holds a correct one
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
    ],
)
def test_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_matches_the_binomial_formula_everywhere():
    for n in range(1, 17):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - comb(n - c, k) / comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


def test_large_n_does_not_overflow():
    assert 0.0 < pass_at_k(2000, 3, 100) < 1.0


@pytest.mark.parametrize("n, c, k", [(8, 9, 1), (8, -1, 1), (8, 2, 0), (8, 2, 9)])
def test_rejects_impossible_arguments(n, c, k):
    with pytest.raises(ConfigError):
        pass_at_k(n, c, k)


def test_parse_ks():
    assert parse_ks("8, 1,4,4", 8) == [1, 4, 8]
    with pytest.raises(ConfigError, match="k=16"):
        parse_ks("1,16", 8)
    with pytest.raises(ConfigError, match="comma-separated"):
        parse_ks("1;4", 8)
