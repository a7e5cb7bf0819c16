"""Paired bootstrap: how sure we are about the mean difference of two arms over one set of
problems.

Each problem contributes one pair (baseline value, ESamp value). Resampling problems with
replacement and recomputing the mean of (ESamp - baseline) gives the spread of that mean; the
2.5th and 97.5th percentiles make a 95% interval. Pairing matters: the same problem is hard or easy
for both arms, and that shared variance cancels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Delta:
    baseline: float  # mean of the baseline values
    esamp: float  # mean of the ESamp values
    delta: float  # esamp - baseline
    low: float  # interval bounds of the delta
    high: float
    problems: int

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("baseline", "esamp", "delta", "low", "high", "problems")}


def paired_bootstrap(
    baseline: Sequence[float], esamp: Sequence[float], resamples: int = 10_000, confidence: float = 0.95, seed: int = 0
) -> Delta:
    """Mean of ``esamp - baseline`` with a percentile bootstrap interval over paired items."""
    a = np.asarray(baseline, dtype=np.float64)
    b = np.asarray(esamp, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired values must be two 1-D arrays of one length, got {a.shape} and {b.shape}")
    m = a.size
    if m == 0:
        nan = float("nan")
        return Delta(nan, nan, nan, nan, nan, 0)
    diff = b - a
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, m, size=(resamples, m))
    means = diff[idx].mean(axis=1)
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(means, [tail, 100.0 - tail])
    return Delta(float(a.mean()), float(b.mean()), float(diff.mean()), float(low), float(high), m)
