"""The fused Distiller step (``esamp.core.backends.triton_distiller``) against the PyTorch step.

Two banks of the same seed take the same steps on random layouts, one on the PyTorch path (the
reference) and one on the kernels: slots joining and leaving, padded blocks, one row and many
(more than one row block), rows that do not train, the shared Distiller, tap norms with either
offset or none, Adam and SGD. Every step's ŷ, e and losses agree, and so do the parameters,
Adam's moments and the step counts after it. The kernels run in Triton's interpreter on the CPU
(exact fp32 products) and on a GPU (fp32-faithful products, then the default TF32 ones within
the tolerance the README states).
"""

from __future__ import annotations

import pytest
import torch

from esamp.core.distiller import DistillerBank, RowLayout, TapNorm, TapNorms

from _interpreter import in_tritons_interpreter

CUDA = torch.cuda.is_available()


def _steps(gen: torch.Generator, shared: bool):
    """(slots of each row, which rows train, padding) of a sequence of steps."""
    if shared:
        return [([0] * 5, None, None), ([0] * 21, [i % 3 != 0 for i in range(21)], None), ([0], None, (2, 32))]
    return [
        ([0, 0, 1, 1, 1], None, None),  # two groups
        ([2, 0, 2], [True, False, True], None),  # 1 left, 2 joined; a row that does not train
        ([0] * 3 + [2] * 18, None, (4, 32)),  # more than one row block, padded units and width
        ([1], None, None),  # one row
        ([2, 1, 2, 1, 0], [False] * 5, None),  # nothing trains: ŷ and e only
    ]


NORMS = ((0.0, torch.bfloat16), (1.0, torch.float32), (None, torch.float32))  # tap norm offset, taps' dtype
# Every (shared, optimizer, norms) case: on a GPU, where a case takes milliseconds.
EVERY = [(shared, opt, norm) for shared in (False, True) for opt in ("adam", "sgd") for norm in NORMS]
# A covering set for Triton's interpreter, where a case takes seconds: each pair of the Distiller's
# mode and optimizer once, and each tap-norm variant (offset 0 in bf16, offset 1, none) in both modes.
COVERING = [
    (False, "adam", NORMS[0]),
    (False, "sgd", NORMS[1]),
    (False, "adam", NORMS[2]),
    (True, "adam", NORMS[1]),
    (True, "sgd", NORMS[0]),
    (True, "sgd", NORMS[2]),
]


def run_steps(device: str, precision: str, hidden: int = 200, rank: int = 8, seed: int = 0, cases=tuple(EVERY)) -> dict:
    """The largest differences between the two paths over ``cases`` (relative to each value's scale)."""
    worst: dict[str, float] = {}

    def note(name, got, want, scale=None):
        got, want = got.detach().double().cpu(), want.detach().double().cpu()
        assert torch.isfinite(got).all(), name
        scale = want.abs().max().clamp(min=1e-6) if scale is None else scale
        worst[name] = max(worst.get(name, 0.0), float((got - want).abs().max() / scale))

    for shared, optimizer, (offset, dtype) in cases:
        gen = torch.Generator().manual_seed(seed)
        banks = [
            DistillerBank(hidden, rank=rank, slots=3, lr=LR, optimizer=optimizer, device=device,
                          seed=seed, shared=shared, backend=backend)
            for backend in ("torch", "fused")
        ]  # fmt: skip
        banks[1].precision = precision
        for b in banks:
            for group in ("a", "b", "c"):
                b.allocate(group)
        norms = None
        if offset is not None:
            w = (0.5 + torch.rand(hidden, generator=gen)).to(dtype).to(device)
            norms = TapNorms(TapNorm(w, 1e-6, offset), TapNorm(w.flip(0), 1e-5, offset))
        for i, (slots, trains, pad) in enumerate(_steps(gen, shared)):
            if i == 3:  # group b leaves: its slot starts again from its initial weights
                for b in banks:
                    b.free("b")
            R = len(slots)
            # the taps as the engine keeps them: x and y column blocks of one buffer, row R zero
            taps = (torch.randn(R + 1, 2 * hidden, generator=gen) * 3).to(dtype).to(device)
            taps[R:] = 0
            x, y = taps[:, :hidden], taps[:, hidden:]
            layout = RowLayout.from_slots(
                slots,
                trains,
                units=None if pad is None else (1 if shared else pad[0]),
                width=None if pad is None else pad[1],
                scratch=banks[0].scratch,
                device=device,
            )
            (p0, e0, l0), (p1, e1, l1) = (b.step(x, y, layout, norms) for b in banks)
            assert banks[1].fused(x, y, norms) and not banks[0].fused(x, y, norms)
            note("prediction", p1[:R], p0[:R])
            note("errors", e1[:R], e0[:R])
            if layout.training:
                note("losses", l1, l0)
            else:
                assert l0 is None and l1 is None
            s0, s1 = banks[0].store, banks[1].store
            assert torch.equal(s1.steps, s0.steps)
            # Adam moves a weight whose gradient is near 0 by about lr·m/√v: a rounding
            # difference there moves it by a share of lr (the split test sees the same).
            note("parameters / lr", s1.flat, s0.flat, LR)
            if optimizer == "adam":
                note("first moments", s1.flat_m, s0.flat_m)
                note("second moments", s1.flat_v, s0.flat_v)
    return worst


LR = 3e-3
# The largest difference each check allows: relative to the value's scale, parameters in units of
# lr. Exact products (the interpreter, "ieee" on a GPU) differ only in the order of their sums
# (measured at H 1000 on an H200: ŷ 1.7e-5, parameters 0.03 lr; tf32x3 ŷ 3.7e-5).
EXACT = {"prediction": 1e-4, "errors": 2e-5, "losses": 2e-5, "parameters / lr": 0.1, "moments": 5e-5}
# TF32 products (the default on a GPU) round their inputs to 10-bit mantissas (measured: ŷ 1.3e-2
# of its scale, e 5e-4, losses 3e-5, moments 5e-3); Adam then moves a weight whose gradient is near
# 0 by up to 2 lr either way. The learning it gives is the fp32 path's to 0.02%
# (benchmarks/fused_learning.py).
TF32 = {"prediction": 3e-2, "errors": 5e-3, "losses": 1e-3, "parameters / lr": 3.0, "moments": 2e-2}
TOLERANCE = {"ieee": EXACT, "tf32x3": EXACT, "tf32": TF32}


def check(device: str, precision: str, hidden: int = 1000, tiles: dict | None = None, cases=tuple(EVERY)) -> dict:
    """``run_steps`` within ``TOLERANCE``; ``tiles`` sets the kernels' tile sizes for the run (smaller
    ones give a small ``hidden`` several slices, so every tail sums partials of several programs)."""
    from esamp.core.backends import triton_distiller as kernels

    saved = {name: getattr(kernels, name) for name in (tiles or {})}
    for name, value in (tiles or {}).items():
        setattr(kernels, name, value)
    try:
        worst = run_steps(device, precision, hidden, cases=cases)
    finally:
        for name, value in saved.items():
            setattr(kernels, name, value)
    limits = TOLERANCE[precision]
    bad = {k: v for k, v in worst.items() if v > limits[k.split()[-1] if k.endswith("moments") else k]}
    assert not bad, (precision, worst)
    return worst


def test_the_interpreters_cases_cover_every_mode_optimizer_and_tap_norm():
    assert {(shared, opt) for shared, opt, _ in COVERING} == {(shared, opt) for shared, opt, _ in EVERY}
    assert {(shared, norm) for shared, _, norm in COVERING} == {(shared, norm) for shared, _, norm in EVERY}


# The interpreter run of this module, started early by the run (tests/core/_interpreter.py). H 200
# in slices of 32 (E1) and 64 (the others): 7 and 4 partials per tail, summed two at a time (KB 2:
# every tail takes several steps, E1's last one partial). Every program the interpreter runs costs
# Python time: these tiles take half as long as slices of 16 and 32. Then one case with the learn
# kernels as 3 programs taking their slices in turn (LP; up to 4 units of 4 and 7 slices: a
# program's turns cross units, and L1's tails sum partials written by other programs' turns).
INTERPRETER_RUNS = {
    "test_the_fused_step_equals_the_pytorch_step_in_tritons_interpreter": (
        "import sys; sys.path.insert(0, 'tests/core'); import test_fused_distiller as t; "
        "t.check('cpu', 'ieee', 200, dict(BK=32, SUBS=1, BH=64, KB=2), t.COVERING); "
        "t.check('cpu', 'ieee', 200, dict(BK=32, SUBS=1, BH=64, KB=2, LP=3), t.COVERING[:1])"
    )
}


@pytest.mark.skipif(CUDA, reason="the kernels run on the GPU there")
def test_the_fused_step_equals_the_pytorch_step_in_tritons_interpreter():
    code = INTERPRETER_RUNS["test_the_fused_step_equals_the_pytorch_step_in_tritons_interpreter"]
    done = in_tritons_interpreter(code, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", sorted(TOLERANCE))
def test_the_fused_step_equals_the_pytorch_step_on_a_gpu(precision):
    check("cuda", precision)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_learn_kernels_taking_their_slices_in_turn_equal_the_pytorch_step_on_a_gpu():
    """ESAMP_DISTILLER_TILES=LP=…: L1 and L2 as a few programs, each taking slices in turn."""
    check("cuda", "ieee", tiles=dict(LP=5), cases=COVERING)


def test_set_tiles_takes_each_tile_and_warps_and_names_them_for_any_other(monkeypatch):
    """ESAMP_DISTILLER_TILES (``set_tiles``): each tile and kernel's warps by name; the learn kernels'
    grid follows LP; an unknown name is refused with the names it takes, a value that is not a
    whole number (or 0 where only LP takes it) with what it takes, each before any tile changes."""
    kernels = pytest.importorskip("esamp.core.backends.triton_distiller")
    for name in kernels.TILES:
        monkeypatch.setattr(kernels, name, getattr(kernels, name))
    monkeypatch.setattr(kernels, "WARPS", dict(kernels.WARPS))
    kernels.set_tiles("BH=64, LP=12,l2=8")
    assert (kernels.BH, kernels.LP, kernels.WARPS["l2"]) == (64, 12, 8)
    assert kernels._learn_grid(units=4, slices=28) == (12,) and kernels._learn_grid(units=1, slices=5) == (5,)
    kernels.set_tiles("LP=0")
    assert kernels._learn_grid(units=4, slices=28) == (4, 28)
    with pytest.raises(ValueError, match=r"no tile 'BQ' \(BK, SUBS, BH, KB, LP, e1, e2, e3, l1, l2\)"):
        kernels.set_tiles("BQ=3")
    for spec, words in (
        ("LP=abc", "LP takes a whole number of at least 0, not 'abc'"),
        ("LP=-2", "LP takes a whole number of at least 0, not '-2'"),
        ("BH=0", "BH takes a whole number of at least 1, not '0'"),
        ("l1=", "l1 takes a whole number of at least 1, not ''"),
        ("BH=32,LP=x", "LP takes a whole number of at least 0, not 'x'"),  # BH stays as it was
    ):
        with pytest.raises(ValueError, match=words):
            kernels.set_tiles(spec)
    assert (kernels.BH, kernels.LP, kernels.WARPS["l1"]) == (64, 0, 8)  # nothing changed
