"""The diversity–accuracy frontier: does an ESamp cell beat "just raise the temperature"?

The *temperature curve* is the baseline and the plain arms that differ from it in temperature
only, joined in order of temperature: a broken line through their (Vendi, pass@k) points, Vendi
being how different a problem's n replies are and pass@k how often they are right. Sampling hotter
moves along it, usually to more diverse and less accurate replies.

A point (an ESamp cell, or a plain arm off the curve such as min-p at high temperature) lies
*above* the curve when its pass@k is higher than the curve's at the same Vendi. That difference is
the point's *gap*:

    gap = pass@k(point) - curve(Vendi(point))

- Where the line passes one Vendi more than once (a noisy curve can fold back), the highest
  pass@k there counts: "above" means above everything some temperature reaches at that diversity.
- Outside the curve's Vendi range there is no gap: nothing is extrapolated. A colder or hotter
  plain arm widens the range.
- The gap's 95% interval is a paired bootstrap over problems: each resample draws problems with
  replacement, recomputes every arm's mean Vendi and pass@k on them, redraws the curve and reads it
  at the point's Vendi. The noise of the curve and of the point, on both axes, is in the interval.
  Resamples where the point falls outside the curve's range are left out and counted
  (``outside``, a share).
- The verdict: ``outside`` when the point lies beyond the curve's Vendi range or more than
  ``EDGE`` of the resamples do (at the curve's end the interval would rest on the resamples that
  happen to reach it); else ``above`` when the interval's low end is above 0, ``below`` when its
  high end is below 0, ``on`` (the curve, within the interval) otherwise.

A task without answers (``open``) has no pass@k: its frontier says, for each point, at which
temperature plain sampling is as diverse (``temperature_equivalent``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

ABOVE, BELOW, ON, OUTSIDE = "above", "below", "on", "outside"
CONFIDENCE = 0.95
EDGE = 0.05  # the most resamples that may fall off the curve for a point to get a verdict


def curve_value(xs: np.ndarray, ys: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The broken line through the points ``(xs[..., i], ys[..., i])``, joined in index order, read
    at ``x``: the highest value where it passes ``x`` more than once, NaN where it never does.

    ``xs``, ``ys``: (..., points); ``x``: (...); leading axes (resamples) broadcast.
    """
    xs, ys, x = np.asarray(xs, float), np.asarray(ys, float), np.asarray(x, float)
    best = np.full(np.broadcast_shapes(x.shape, xs.shape[:-1]), -np.inf)
    for i in range(xs.shape[-1] - 1):
        x0, x1, y0, y1 = xs[..., i], xs[..., i + 1], ys[..., i], ys[..., i + 1]
        inside = (x >= np.minimum(x0, x1)) & (x <= np.maximum(x0, x1))
        span = x1 - x0
        flat = span == 0  # both ends at one Vendi: the better end
        with np.errstate(divide="ignore", invalid="ignore"):
            y = np.where(flat, np.maximum(y0, y1), y0 + (x - x0) / np.where(flat, 1.0, span) * (y1 - y0))
        best = np.where(inside, np.maximum(best, y), best)
    return np.where(np.isinf(best), np.nan, best)


def temperature_at(xs: Sequence[float], temperatures: Sequence[float], x: float) -> float | None:
    """The lowest temperature at which the curve (Vendi ``xs`` at ``temperatures``, in order)
    reaches Vendi ``x``, interpolated linearly; None outside its range."""
    for x0, x1, t0, t1 in zip(xs, xs[1:], temperatures, temperatures[1:]):
        if min(x0, x1) <= x <= max(x0, x1):
            return t0 if x1 == x0 else t0 + (x - x0) / (x1 - x0) * (t1 - t0)
    return None


def _interval(values: np.ndarray) -> tuple[float, float]:
    values = values[~np.isnan(values)]
    if not values.size:
        return float("nan"), float("nan")
    tail = (1.0 - CONFIDENCE) / 2.0 * 100.0
    low, high = np.percentile(values, [tail, 100.0 - tail])
    return float(low), float(high)


def verdict(gap: float, low: float, high: float, outside: float = 0.0) -> str:
    if np.isnan(gap) or outside > EDGE:
        return OUTSIDE
    if low > 0:
        return ABOVE
    if high < 0:
        return BELOW
    return ON


def analyse(
    curve: Mapping[str, float],
    vendi: Mapping[str, Sequence[float]],
    scores: Mapping[str, Mapping[str, Sequence[float]]],
    resamples: int = 10_000,
    seed: int = 0,
) -> dict:
    """The frontier of one task.

    ``curve``: the arms of the temperature curve and their temperatures; ``vendi``: every arm's
    per-problem Vendi; ``scores``: per metric (pass@1, ...), every arm's per-problem values, on the
    same problems in the same order. Every arm not on the curve is a point compared with it.
    """
    arms = list(vendi)
    on_curve = sorted(curve, key=curve.get)
    points = [a for a in arms if a not in curve]
    temps = [curve[a] for a in on_curve]
    x = np.array([vendi[a] for a in arms], dtype=float)  # (arms, problems)
    m = x.shape[1]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, m, size=(resamples, m))
    row = {a: i for i, a in enumerate(arms)}
    cols = [row[a] for a in on_curve]

    def boot(values: np.ndarray) -> np.ndarray:  # (arms, problems) -> (resamples, arms)
        return np.stack([v[idx].mean(axis=1) for v in values], axis=1)  # one arm at a time: memory

    x_mean, x_boot = x.mean(axis=1), boot(x)
    out: dict = {
        "curve": on_curve,
        "temperatures": dict(zip(on_curve, temps)),
        "problems": m,
        "vendi_range": [float(x_mean[cols].min()), float(x_mean[cols].max())],
        "points": {a: {"vendi": _summary(x_mean[row[a]], x_boot[:, row[a]])} for a in arms},
        "gaps": {},
        "temperature_equivalent": {a: temperature_at(list(x_mean[cols]), temps, float(x_mean[row[a]])) for a in points},
    }
    for metric, by_arm in scores.items():
        y = np.array([by_arm[a] for a in arms], dtype=float)
        y_mean, y_boot = y.mean(axis=1), boot(y)
        for a in arms:
            out["points"][a][metric] = _summary(y_mean[row[a]], y_boot[:, row[a]])
        gaps = {}
        for a in points:
            i = row[a]
            gap = float(y_mean[i] - curve_value(x_mean[cols], y_mean[cols], x_mean[i]))
            spread = y_boot[:, i] - curve_value(x_boot[:, cols], y_boot[:, cols], x_boot[:, i])
            low, high = _interval(spread)
            off = float(np.isnan(spread).mean())
            gaps[a] = {"gap": gap, "low": low, "high": high, "outside": off, "verdict": verdict(gap, low, high, off)}
        out["gaps"][metric] = gaps
    return out


def _summary(mean: float, boot: np.ndarray) -> dict:
    low, high = _interval(boot)
    return {"mean": float(mean), "low": low, "high": high}


def standing(frontier: dict, metric: str, arms: Sequence[str]) -> dict[str, list[str]]:
    """``arms`` sorted by verdict on ``metric``: {"above": [...], "on": [...], ...}."""
    out: dict[str, list[str]] = {ABOVE: [], ON: [], BELOW: [], OUTSIDE: []}
    for arm in arms:
        out[frontier["gaps"][metric][arm]["verdict"]].append(arm)
    return out
