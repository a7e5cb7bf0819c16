"""The ESamp mixes, each defined once: z'_c = a·z̃_c − b·d_c on the candidates, (a, b) from β.

z̃ = z/T are the model's logits over the temperature and d = W_lm·ŷ the Distiller logits. Every
path that mixes takes its coefficients from ``coefficients``: the PyTorch reference
(``esamp.core.intervention.mixed``), the fused kernel (``esamp.core.backends.triton_mix``) and the
vLLM processor's per-row tensors. Adding a mix is one entry in ``MIXES``.

With β = 0 every mix must give (a, b) = (1, 0), so that steering with β = 0 is plain sampling.

Pure Python (no torch): the settings import it, and ``esamp --help`` should not load torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal


@dataclass(frozen=True)
class MixRule:
    formula: str  # how docs/algorithm.md and ``--help`` write it
    coefficients: Callable[[float], tuple[float, float]]  # β → (a, b)


MIXES: dict[str, MixRule] = {
    # The paper's mix. (1+β)·z/T also sharpens the model's own distribution: at T 0.8, β 0.8 the
    # LLM term acts like a temperature of about 0.44.
    "paper": MixRule("(1+β)·z/T − β·d", lambda beta: (1.0 + beta, beta)),
    # The same reward for novelty without the extra sharpening.
    "unsharpened": MixRule("z/T − β·d", lambda beta: (1.0, beta)),
}

MixName = Literal[tuple(MIXES)]  # type: ignore[valid-type]


def coefficients(name: str, beta: float) -> tuple[float, float]:
    """(a, b) of z' = a·z̃ − b·d for the mix called ``name`` at strength ``beta``."""
    try:
        return MIXES[name].coefficients(float(beta))
    except KeyError:
        raise ValueError(f"unknown mix {name!r}; expected one of {', '.join(MIXES)}") from None


def describe() -> str:
    """One line naming every mix and its formula, for help texts."""
    return "; ".join(f"{name}: {m.formula}" for name, m in MIXES.items())
