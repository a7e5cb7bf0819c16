"""The ESamp mixes, each defined once: z'_c = a·z̃_c − b·d_c on the candidates, (a, b) from β.

z̃ = z/T are the model's logits over the temperature and d = W_lm·ŷ the Distiller logits. Every
path that mixes takes its coefficients from ``coefficients``: the PyTorch reference
(``esamp.core.intervention.mixed``), the fused kernel (``esamp.core.backends.triton_mix``) and the
vLLM processor's per-row tensors. Adding a mix is one entry in ``MIXES``.

A mix with ``entropy_matched`` then rescales each row's z' over C by the λ > 0 that gives
softmax(λ·z') on C the entropy of softmax(z̃) on C, plain sampling's
(``esamp.core.intervention.match_entropy``). λ depends on statistics over C, which the (a, b)
form cannot carry: the fused GPU filter leaves such rows to the steerer's PyTorch path.

With β = 0 every mix must give (a, b) = (1, 0), so that steering with β = 0 is plain sampling.

Pure Python (no torch): the settings import it, and ``esamp --help`` should not load torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class MixRule:
    formula: str  # how docs/algorithm.md and ``--help`` write it
    coefficients: Callable[[float], tuple[float, float]]  # β → (a, b)
    entropy_matched: bool = False  # z' rescaled per row to plain sampling's entropy over C


MIXES: dict[str, MixRule] = {
    # The paper's mix. (1+β)·z/T also sharpens the model's own distribution: at T 0.8, β 0.8 the
    # LLM term acts like a temperature of about 0.44.
    "paper": MixRule("(1+β)·z/T − β·d", lambda beta: (1.0 + beta, beta)),
    # The same reward for novelty without the extra sharpening. On the embedded model d spreads
    # about twice as widely over C as z/T, so −β·d still sharpens most rows by itself
    # (benchmarks/results/novelty-spread-cpu.json).
    "unsharpened": MixRule("z/T − β·d", lambda beta: (1.0, beta)),
    # Novelty alone: the unsharpened mix brought back to plain sampling's entropy on C, row by
    # row, so it moves mass between candidates but neither sharpens nor flattens them.
    "matched": MixRule(
        "λ·(z/T − β·d), λ per row: plain sampling's entropy on C", lambda beta: (1.0, beta), entropy_matched=True
    ),
}

MixName = Literal[tuple(MIXES)]  # type: ignore[valid-type]


def coefficients(name: str, beta: float) -> tuple[float, float]:
    """(a, b) of z' = a·z̃ − b·d for the mix called ``name`` at strength ``beta``."""
    try:
        return MIXES[name].coefficients(float(beta))
    except KeyError:
        raise ValueError(f"unknown mix {name!r}; expected one of {', '.join(MIXES)}") from None


def matches_entropy(name: str) -> bool:
    """Whether the mix called ``name`` rescales each row to plain sampling's entropy over C."""
    try:
        return MIXES[name].entropy_matched
    except KeyError:
        raise ValueError(f"unknown mix {name!r}; expected one of {', '.join(MIXES)}") from None


def describe() -> str:
    """One line naming every mix and its formula, for help texts."""
    return "; ".join(f"{name}: {m.formula}" for name, m in MIXES.items())
