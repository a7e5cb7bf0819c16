"""Raw Distiller error → novelty in [0, 1], the same mapping in every engine.

Per prompt group we keep an exponential moving mean μ and variance σ² of the raw row errors
(weight ``ALPHA`` per step).  A row's novelty is

    novelty = sigmoid((e − μ) / σ)        with μ, σ from *before* the row's step

so 0.5 means "as surprising as this group's recent tokens", values near 1 mark tokens the
Distiller did not see coming.  The first step of a group has no history and maps to 0.5.
Normalising per group (not globally) keeps a long prompt's falling loss from washing out the
heat of every later token; σ is floored at 5% of μ so a flat run does not amplify noise.
"""

from __future__ import annotations

import math

ALPHA = 0.1
SIGMA_FLOOR = 0.05


class NoveltyNormalizer:
    def __init__(self) -> None:
        self._stats: dict[str, tuple[float, float]] = {}  # group → (mean, variance)

    def normalise(self, group: str, errors: list[float]) -> list[float]:
        """Novelty for one step's raw errors of ``group``, then fold them into its statistics."""
        if not errors:
            return []
        stats = self._stats.get(group)
        if stats is None:
            out = [0.5] * len(errors)
            mean = sum(errors) / len(errors)
            var = sum((e - mean) ** 2 for e in errors) / len(errors)
        else:
            mean, var = stats
            sigma = max(math.sqrt(var), SIGMA_FLOOR * abs(mean), 1e-12)
            out = [_sigmoid((e - mean) / sigma) for e in errors]
            for e in errors:
                delta = e - mean
                mean += ALPHA * delta
                var = (1 - ALPHA) * (var + ALPHA * delta * delta)
        self._stats[group] = (mean, var)
        return out

    def forget(self, group: str) -> None:
        self._stats.pop(group, None)


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    ez = math.exp(z)
    return ez / (1.0 + ez)
