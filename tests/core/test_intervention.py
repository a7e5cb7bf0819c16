import torch

from esamp.core import intervention as iv


def _rows(R, value, dtype=torch.float32):
    return torch.full((R,), value, dtype=dtype)


def test_candidate_mask_top_k_top_p_min_p():
    # probabilities 0.5, 0.25, 0.125, 0.0625, ... (descending powers of two)
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]]))
    keep_all = iv.candidate_mask(logits, _rows(1, 0, torch.long), _rows(1, 1.0), _rows(1, 0.0))
    assert keep_all.all()
    top2 = iv.candidate_mask(logits, _rows(1, 2, torch.long), _rows(1, 1.0), _rows(1, 0.0))
    assert top2.tolist() == [[True, True, False, False, False]]
    # top-p 0.7: 0.5 alone is below 0.7, so the crossing token 0.25 is kept, 0.125 is not
    nucleus = iv.candidate_mask(logits, _rows(1, 0, torch.long), _rows(1, 0.7), _rows(1, 0.0))
    assert nucleus.tolist() == [[True, True, False, False, False]]
    # min-p 0.3: keep p >= 0.15
    minp = iv.candidate_mask(logits, _rows(1, 0, torch.long), _rows(1, 1.0), _rows(1, 0.3))
    assert minp.tolist() == [[True, True, False, False, False]]


def test_argmax_is_always_a_candidate():
    torch.manual_seed(0)
    logits = torch.randn(16, 100) * 5
    mask = iv.candidate_mask(logits, _rows(16, 1, torch.long), _rows(16, 0.01), _rows(16, 0.99))
    assert mask.sum(dim=-1).tolist() == [1] * 16
    assert mask.gather(1, logits.argmax(-1, keepdim=True)).all()


def test_width_hint_gives_the_same_mask():
    torch.manual_seed(1)
    logits = torch.randn(8, 500) * 3
    args = (_rows(8, 0, torch.long), _rows(8, 0.9), _rows(8, 0.05))
    assert torch.equal(iv.candidate_mask(logits, *args), iv.candidate_mask(logits, *args, width=500))


def test_beta_zero_is_the_identity_on_candidates_and_minus_inf_elsewhere():
    torch.manual_seed(2)
    R, V, H = 4, 300, 16
    scaled = torch.randn(R, V) * 2
    mask = iv.candidate_mask(scaled, _rows(R, 0, torch.long), _rows(R, 0.9), _rows(R, 0.05))
    a, b = iv.mix_coefficients([("paper", 0.0)] * R)
    out = iv.steer(scaled, mask, torch.randn(R, H), torch.randn(V, H), a, b)
    assert torch.equal(out[mask], scaled[mask])
    assert torch.isneginf(out[~mask]).all()
    assert torch.equal(out, iv.filtered_logits(scaled, mask))


def test_mix_formulas_on_candidates():
    torch.manual_seed(3)
    R, V, H = 3, 50, 8
    scaled = torch.randn(R, V)
    pred, W = torch.randn(R, H), torch.randn(V, H)
    mask = torch.zeros(R, V, dtype=torch.bool)
    mask[:, :5] = True
    mask[0, 7] = True
    d = pred @ W.T
    paper = iv.steer(scaled, mask, pred, W, *iv.mix_coefficients([("paper", 0.8)] * R))
    flat = iv.steer(scaled, mask, pred, W, *iv.mix_coefficients([("unsharpened", 0.8)] * R))
    torch.testing.assert_close(paper[mask], ((1.8 * scaled) - 0.8 * d)[mask])
    torch.testing.assert_close(flat[mask], (scaled - 0.8 * d)[mask])
    assert torch.isneginf(paper[~mask]).all() and torch.isneginf(flat[~mask]).all()


def test_distiller_logits_only_gather_candidate_rows():
    torch.manual_seed(4)
    pred, W = torch.randn(2, 8), torch.randn(40, 8)
    ids = torch.tensor([[3, 7], [0, 39]])
    d = iv.distiller_logits_at(pred, W, ids)
    torch.testing.assert_close(d, (pred @ W.T).gather(1, ids))


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    out = iv.sample(logits, torch.tensor([True, True]), gen)
    assert out.tolist() == [1, 0]


# -- the entropy-matched mix ------------------------------------------------------------------


def _steer(mix, beta, scaled, mask, pred, W):
    rows = [(mix, beta)] * scaled.shape[0]
    matched = torch.tensor(iv.entropy_matched(rows)).reshape(-1, 1)
    return iv.steer(scaled, mask, pred, W, *iv.mix_coefficients(rows), matched=matched)


def _entropy(logits, mask):
    return iv.candidate_entropy(logits.masked_fill(~mask, float("-inf")))


def test_the_matched_mix_keeps_plain_samplings_entropy_and_moves_mass_by_novelty():
    torch.manual_seed(5)
    R, V, H = 6, 80, 8
    scaled = torch.randn(R, V) * 2
    mask = torch.zeros(R, V, dtype=torch.bool)
    mask[:, :4] = True
    mask[0, 10:30] = True  # one wide row
    pred, W = torch.randn(R, H), torch.randn(V, H)
    out = _steer("matched", 0.8, scaled, mask, pred, W)
    torch.testing.assert_close(_entropy(out, mask), _entropy(scaled, mask), atol=1e-5, rtol=0)
    assert torch.isneginf(out[~mask]).all()
    # the same candidates ranked as z/T − β·d ranks them: λ > 0 only rescales the unsharpened mix
    flat = iv.steer(scaled, mask, pred, W, *iv.mix_coefficients([("unsharpened", 0.8)] * R))
    for r in range(R):
        assert torch.equal(out[r][mask[r]].argsort(), flat[r][mask[r]].argsort())
    # and the mass did move: the candidate distributions differ from plain sampling's
    assert not torch.allclose(out.softmax(-1), scaled.masked_fill(~mask, float("-inf")).softmax(-1), atol=1e-3)


def test_the_matched_mix_is_plain_sampling_bit_for_bit_without_novelty():
    """β = 0, or a Distiller whose logits are the same at every candidate: z/T on C exactly."""
    torch.manual_seed(6)
    R, V, H = 4, 60, 8
    scaled = torch.randn(R, V) * 2
    mask = iv.candidate_mask(scaled, _rows(R, 0, torch.long), _rows(R, 0.95), _rows(R, 0.05))
    plain = iv.filtered_logits(scaled, mask)
    pred, W = torch.randn(R, H), torch.randn(V, H)
    assert torch.equal(_steer("matched", 0.0, scaled, mask, pred, W), plain)
    same = torch.zeros(V, H)
    same[:, 0] = 1.0  # every token's row of the LM head alike: d is constant over C, whatever ŷ is
    assert torch.equal(_steer("matched", 0.8, scaled, mask, pred, same), plain)
    gen = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)]
    for _ in range(50):
        assert torch.equal(
            iv.sample(_steer("matched", 0.8, scaled, mask, pred, same), _rows(R, False, torch.bool), gen[0]),
            iv.sample(plain, _rows(R, False, torch.bool), gen[1]),
        )


def test_entropy_matching_touches_only_the_rows_it_is_given():
    torch.manual_seed(7)
    scaled = torch.randn(3, 20)
    mixed, novelty = torch.randn(3, 20), torch.randn(3, 20)
    out = iv.match_entropy(mixed, scaled, novelty, torch.tensor([True, False, True]))
    assert torch.equal(out[1], mixed[1])
    torch.testing.assert_close(
        iv.candidate_entropy(out[[0, 2]]), iv.candidate_entropy(scaled[[0, 2]]), atol=1e-5, rtol=0
    )


def test_matching_whole_rows_at_their_candidates_equals_matching_over_the_vocabulary():
    """``match_entropy_rows`` (the bisection at each row's candidates) gives what the bisection
    over every vocabulary entry gives (−∞ outside C contributes nothing to either), for matched,
    unmatched and uninformative rows, with the width read or given."""
    torch.manual_seed(8)
    R, V = 6, 300
    scaled = torch.randn(R, V) * 3
    mask = torch.zeros(R, V, dtype=torch.bool)
    for r, width in enumerate((1, 2, 5, 17, 40, 9)):
        mask[r, torch.randperm(V)[:width]] = True
    scaled = scaled.masked_fill(~mask, float("-inf"))
    a, b = torch.full((R, 1), 1.8), torch.full((R, 1), 0.8)
    d = torch.randn(R, V)
    d[5] = 0.5  # an uninformative Distiller on the last row: plain sampling, bit for bit
    mixed, novelty = a * scaled - b * d, b * d
    rows = torch.tensor([True, True, True, False, True, True]).reshape(-1, 1)
    dense = iv.match_entropy(mixed, scaled, novelty, rows)
    for width in (None, 40):
        out = iv.match_entropy_rows(mixed, scaled, novelty, rows, width=width)
        assert torch.isneginf(out[~mask]).all() and torch.equal(out[3], mixed[3]) and torch.equal(out[5], scaled[5])
        torch.testing.assert_close(out[mask], dense[mask], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(iv.candidate_entropy(out[[0, 1, 2, 4]]), iv.candidate_entropy(scaled[[0, 1, 2, 4]]))
