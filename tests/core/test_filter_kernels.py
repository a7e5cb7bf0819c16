"""The fused filter-and-mix (``esamp.core.backends.triton_filter``) against the core's exact filter.

The PyTorch twin runs everywhere; the Triton kernels run on a CUDA GPU, and in Triton's
interpreter (on the CPU) wherever Triton is installed.
"""

from __future__ import annotations

import pytest
import torch

from esamp.core import intervention as iv
from esamp.core.backends import triton_filter as tf

from _interpreter import in_tritons_interpreter

CUDA = torch.cuda.is_available()


def _case(seed: int, rows: int = 6, vocab: int = 9_000, ties: bool = False, flat: bool = False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows + 3, vocab, generator=gen) * (0.05 if flat else 1 + 4 * torch.rand(1, generator=gen))
    if ties:  # bf16-valued logits, as a bf16 LM head gives them: many exact ties
        logits = logits.to(torch.bfloat16).float()
    logits[0, :10] = float("-inf")  # a row another processor masked
    index = torch.randperm(rows + 3, generator=gen)[:rows]
    temperature = 0.5 + torch.rand(rows, generator=gen)
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.3, torch.zeros(rows), 0.2 * torch.rand(rows, generator=gen))
    top_p = torch.where(
        torch.rand(rows, generator=gen) < 0.25, torch.ones(rows), 0.5 + 0.5 * torch.rand(rows, generator=gen)
    )
    a = 1 + torch.rand(rows, generator=gen)
    b = torch.rand(rows, generator=gen)
    d = torch.randn(rows // 2, vocab, generator=gen).to(torch.bfloat16)
    return logits, index, temperature, min_p, top_p, a, b, d


def check_kernels(device: str, seeds=range(12), short_seeds=(0, 2), vocab: int = 9_000) -> None:
    """The kernels (``launch``) equal the reference on continuous logits, and keep whole tie
    groups on bf16-valued ones (``seeds``: which random cases; seed 5 is flat, every third has ties;
    ``short_seeds``: the cases the two-launch path is held to the whole one on; ``vocab`` over
    ``tf.BLOCK``: rows of several blocks, the last one partial)."""
    assert vocab > tf.BLOCK and vocab % tf.BLOCK and vocab * 4 // 9 > tf.EDGE
    for seed in seeds:
        ties = seed % 3 == 2
        flat = seed == 5
        logits, index, T, m, p, a, b, d = _case(seed, vocab=vocab, ties=ties, flat=flat)
        want = logits.clone()
        tf.filter_and_mix_torch(want, index, T, m, p, a, b, d)
        dev = [t.clone().to(device) for t in (logits, index, T, m, p, a, b, d)]
        got_counts = tf.launch(*dev).cpu()
        got = dev[0].cpu()
        untouched = [r for r in range(logits.shape[0]) if r not in index.tolist()]
        assert torch.equal(got[untouched], logits[untouched]), seed
        kept_want, kept_got = torch.isfinite(want), torch.isfinite(got)
        assert torch.equal(got_counts, kept_got[index].sum(-1).int()), seed
        if ties or flat:
            # a tie at the cut is kept whole, and only ties of the last kept value are added
            assert (kept_got | ~kept_want).all(), seed
            extra = kept_got & ~kept_want
            for r in extra.any(-1).nonzero().flatten().tolist():
                lowest_kept = logits[r][kept_want[r]].min()
                assert (logits[r][extra[r]] == lowest_kept).all(), (seed, r)
        else:
            assert torch.equal(kept_got, kept_want), (seed, (kept_got != kept_want).sum())
        both = kept_want & kept_got
        torch.testing.assert_close(got[both], want[both], rtol=1e-5, atol=1e-4)
    # No row with top-p: the two-launch path (row maxima, then the mix at the min-p floor) keeps
    # exactly what the whole sequence keeps, with the same values.
    for seed in short_seeds:
        logits, index, T, m, p, a, b, d = _case(seed, vocab=vocab, ties=seed % 3 == 2)
        p = torch.ones_like(p)
        whole, short = logits.clone().to(device), logits.clone().to(device)
        rows = [t.to(device) for t in (index, T, m, p, a, b, d)]
        counts_whole = tf.launch(whole, *rows).clone()
        counts_short = tf.launch(short, *rows, cut=False)
        assert torch.equal(short, whole) and torch.equal(counts_short, counts_whole), seed
    # β = 0 (a = 1, b = 0): a mixed row is the filtered row of plain sampling, bit for bit.
    logits, index, T, m, p, a, b, d = _case(3, vocab=vocab)
    rows = [t.to(device) for t in (index, T, m, p)]
    plain, mixed = logits.clone().to(device), logits.clone().to(device)
    tf.launch(plain, *rows, a.to(device), b.to(device), None)
    tf.launch(mixed, *rows, torch.ones_like(a).to(device), torch.zeros_like(b).to(device), d.to(device))
    assert torch.equal(mixed, plain)
    # A tie group at the cut larger than what is sorted (``tf.EDGE``) is kept whole (the tie rule),
    # and counted: the top tie group holds 5/9 of the mass, top-p 0.9 cuts inside the second one.
    logits = torch.zeros(1, vocab)
    logits[0, vocab * 5 // 9 :] = -1e-3
    index, one = torch.tensor([0]), torch.ones(1)
    work = tf.FilterWorkspace(1, vocab, torch.device(device))
    counts = tf.launch(
        logits.to(device),
        index.to(device),
        one.to(device),
        (0.1 * one).to(device),
        (0.9 * one).to(device),
        one.to(device),
        0 * one.to(device),
        None,
        work,
    )
    assert int(counts[0]) == vocab and int(work.overflows[0]) == 1


def check_head_product(device: str, vocab: int = 700, hidden: int = 40) -> None:
    """d given as its factors (``HeadProduct``: ŷ and the LM head) gives what the full product
    gives, computed at each row's candidates: rows with at most ``CANDIDATES`` of them, rows with
    more (min-p and top-p off over a vocabulary wider than that: the tiled product), filtered-only
    rows and a row with a cut; the padded head's extra rows are never read. β = 0 stays plain."""
    gen = torch.Generator().manual_seed(7)
    rows = 7
    logits = torch.randn(rows + 2, vocab, generator=gen) * 3
    index = torch.randperm(rows + 2, generator=gen)[:rows]
    T = 0.5 + torch.rand(rows, generator=gen)
    min_p = torch.tensor([0.05, 0.0, 0.1, 0.0, 0.02, 0.05, 0.0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 0.8])
    a, b = 1 + torch.rand(rows, generator=gen), torch.rand(rows, generator=gen)
    head = torch.randn(vocab + 5, hidden, generator=gen).to(torch.bfloat16)
    head[vocab:] = float("nan")  # padding rows: reading one would spoil a row
    yhat = torch.randn(5, hidden, generator=gen).to(torch.bfloat16)  # rows 0-4 mixed, 5-6 only filtered
    dense = yhat.float() @ head[:vocab].float().t()
    want = logits.clone()
    want_counts = tf.filter_and_mix_torch(want, index, T, min_p, top_p, a, b, dense)
    assert int(want_counts[1]) > tf.CANDIDATES and int(want_counts[0]) <= tf.CANDIDATES  # both paths run
    dev = [t.to(device) for t in (index, T, min_p, top_p, a, b)]
    got = logits.clone().to(device)
    product = iv.HeadProduct(yhat.to(device), head.to(device))
    counts = tf.launch(got, *dev, product, tf.FilterWorkspace(rows, vocab, torch.device(device)))
    got = got.cpu()
    assert torch.equal(counts.cpu(), want_counts)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    kept = torch.isfinite(want)
    # fp32 sums over H in another order than the reference's product: a few ulps of the largest b·d
    scale = float((dense.abs().amax(-1) * b[: dense.shape[0]]).max())
    torch.testing.assert_close(got[kept], want[kept], rtol=1e-5, atol=1e-4 + 1e-5 * scale)
    # the PyTorch twin multiplies the factors out: the LM head's own product, in its dtype
    twin = logits.clone()
    tf.filter_and_mix_torch(twin, index, T, min_p, top_p, a, b, iv.HeadProduct(yhat, head))
    torch.testing.assert_close(twin[kept], want[kept], rtol=2e-2, atol=5e-2 + 1e-2 * scale)  # d rounded to bf16
    # β = 0 (a = 1, b = 0): the filtered row of plain sampling, bit for bit
    plain, mixed = logits.clone().to(device), logits.clone().to(device)
    tf.launch(plain, *dev[:4], dev[4], dev[5], None)
    one, zero = torch.ones(rows, device=device), torch.zeros(rows, device=device)
    tf.launch(mixed, *dev[:4], one, zero, product)
    assert torch.equal(mixed, plain)


def check_captured_form(device: str, vocab: int = 5_000, hidden: int = 40) -> None:
    """The form a captured launch replays (``launch`` with ``LogitsAt``, rows padded with -1 and
    a device count of mixed rows) changes exactly what the direct launch changes, with and without
    the top-p passes (flat rows too, which narrow their cut), d dense and as its factors: padding
    rows are never read (their settings would poison a row), every row outside the listed ones is
    left alone, and the padding's counts are 0."""
    gen = torch.Generator().manual_seed(11)
    for cut, sparse, flat in ((True, True, False), (True, True, True), (False, True, False), (True, False, False)):
        logits, index, T, m, p, a, b, _ = _case(4 if cut else 1, vocab=vocab, flat=flat)
        if not cut:
            p = torch.ones_like(p)
        n, k, pad = index.numel(), 3, 5
        head = torch.randn(vocab + 3, hidden, generator=gen).to(torch.bfloat16)
        yhat = torch.randn(n + pad, hidden, generator=gen).to(torch.bfloat16)  # rows past k: never read
        direct = iv.HeadProduct(yhat[:k], head) if sparse else (yhat[:k].float() @ head[:vocab].float().t())
        padded = iv.HeadProduct(yhat, head) if sparse else (yhat.float() @ head[:vocab].float().t())
        want = logits.clone().to(device)
        args = [t.to(device) for t in (index, T, m, p, a, b)]
        want_counts = tf.launch(want, *args, _to(direct, device), cut=cut).clone()
        junk = torch.full((pad,), float("nan"))
        rows = torch.cat([index, torch.full((pad,), -1)])
        settings = [torch.cat([t, junk]) for t in (T, m, p, a, b)]
        got = logits.clone().to(device)
        address = torch.tensor([got.data_ptr()], dtype=torch.long, device=device)
        work = tf.FilterWorkspace(n + pad, vocab, torch.device(device))
        counts = tf.launch(
            tf.LogitsAt(address, vocab, got.stride(0)),
            rows.to(device),
            *[t.to(device) for t in settings],
            _to(padded, device),
            work,
            cut=cut,
            mixed=torch.tensor([k], dtype=torch.int32, device=device),
        ).cpu()
        assert torch.equal(got.cpu(), want.cpu()), (cut, sparse, flat)
        assert torch.equal(counts[:n], want_counts.cpu()) and not counts[n:].any(), (cut, sparse, flat)


def _to(d, device: str):
    return iv.HeadProduct(d.prediction.to(device), d.head.to(device)) if isinstance(d, iv.HeadProduct) else d.to(device)


def test_torch_twin_is_the_core_filter_and_mix():
    """Listed rows are filtered (z/T on C) and the first ones mixed (a·z̃ − b·d); others untouched."""
    logits, index, T, m, p, a, b, d = _case(1)
    got = logits.clone()
    counts = tf.filter_and_mix_torch(got, index, T, m, p, a, b, d)
    z = logits[index] / T[:, None]
    mask = iv.candidate_mask(z, torch.zeros(len(index), dtype=torch.long), p, m)
    want = z.masked_fill(~mask, float("-inf"))
    k = d.shape[0]
    want[:k] = torch.where(mask[:k], iv.mixed(z[:k], d.float(), a[:k, None], b[:k, None]), want[:k])
    torch.testing.assert_close(got[index], want)
    assert torch.equal(counts, mask.sum(-1).int())
    rest = [r for r in range(len(logits)) if r not in index.tolist()]
    assert torch.equal(got[rest], logits[rest])


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_kernels_equal_the_reference_on_a_gpu():
    check_kernels("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_captured_form_equals_the_direct_launch_on_a_gpu():
    check_captured_form("cuda")
    check_captured_form("cuda", vocab=152_064, hidden=3584)  # the 7B shapes


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_distiller_logits_at_the_candidates_equal_the_full_product_on_a_gpu():
    check_head_product("cuda")
    check_head_product("cuda", vocab=152_064, hidden=3584)  # the 7B shapes


# How the interpreter tests load the checks. Triton's interpreter runs ``tl.sort`` element by element
# in Python: sorting the shipped ``EDGE`` (1024) survivors takes about 6 s a row, half as many about
# a quarter of that. So these runs sort at most 512 survivors exactly and send rows with more to
# the narrowing passes (the flat case still fits after them; at 256 it would overflow, which the
# checks do not allow); the GPU tests run the shipped size.
INTERPRETED = (
    "import sys; sys.path.insert(0, 'tests/core'); import test_filter_kernels as t; "
    "from esamp.core.backends import triton_filter as tf; tf.EDGE = 512; "
)


# The interpreter runs of this module, started early by the run (tests/core/_interpreter.py):
# continuous, tied and flat logits on rows of two blocks, the short path on tied ones; and d as its
# factors on both of its paths.
INTERPRETER_RUNS = {
    "test_kernels_equal_the_reference_in_tritons_interpreter": INTERPRETED
    + "t.check_kernels('cpu', (0, 2, 5), short_seeds=(2,), vocab=5_000)",
    "test_distiller_logits_at_the_candidates_equal_the_full_product_in_tritons_interpreter": INTERPRETED
    + "t.check_head_product('cpu')",
    "test_the_captured_form_equals_the_direct_launch_in_tritons_interpreter": INTERPRETED
    + "t.check_captured_form('cpu')",
}


@pytest.mark.skipif(CUDA, reason="the kernels run on the GPU there")
def test_the_captured_form_equals_the_direct_launch_in_tritons_interpreter():
    code = INTERPRETER_RUNS["test_the_captured_form_equals_the_direct_launch_in_tritons_interpreter"]
    done = in_tritons_interpreter(code, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(CUDA, reason="the kernels run on the GPU there")
def test_distiller_logits_at_the_candidates_equal_the_full_product_in_tritons_interpreter():
    code = INTERPRETER_RUNS["test_distiller_logits_at_the_candidates_equal_the_full_product_in_tritons_interpreter"]
    done = in_tritons_interpreter(code, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(CUDA, reason="the kernels run on the GPU there")
def test_kernels_equal_the_reference_in_tritons_interpreter():
    done = in_tritons_interpreter(
        INTERPRETER_RUNS["test_kernels_equal_the_reference_in_tritons_interpreter"], timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
