"""Does the Distiller learn within a group? Each arm's loss and novelty against token position.

A steered group's record (``esamp.eval.runner.GroupTrace``) holds the loss of each of its
Distiller's optimizer steps and its samples' mean novelty at each token position. Both are put on
one axis, the position p of a token in the reply:

- the loss at p is that of the group's step whose inputs were the tokens at p, the step s = p + 1
  (the loss is measured before that step's update, on the same rows whose errors give the
  tokens' novelty); p = −1 is the first step, whose input is the prompt's last token;
- the novelty at p is the group's mean over its samples' tokens at p.

Per arm and position: the mean over the arm's groups (each group counts once), with a 95%
interval of that mean (mean ± 1.96·sd/√groups), while at least ``MIN_SHARE`` of the arm's groups
(and ``MIN_GROUPS``) still reach the position: the tail, where a few long replies remain, is left
out. ``windows`` sums a curve up as the mean over its first ``WINDOW`` positions and over the
positions after them.

If the loss falls along the reply while the novelty stays flat, the Distiller is learning the
group as it goes and a token's novelty says how it compares with the group's recent errors
(``esamp.core.novelty`` normalises per group), not how new it is in absolute terms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

WINDOW = 8  # the first positions of a reply, summed up against the rest
MIN_SHARE = 0.25  # a position is kept while at least this share of an arm's groups reach it
MIN_GROUPS = 2  # ... and at least this many
Z95 = 1.96


def curve(series: Sequence[Sequence[float | None]], first: int) -> dict | None:
    """The mean curve of per-group ``series`` (index i is position ``first + i``; None: no value
    there), kept while enough groups have a value; None when no position is kept."""
    groups = sum(any(v is not None for v in s) for s in series)
    least = max(MIN_GROUPS, math.ceil(MIN_SHARE * groups))
    out: dict[str, list] = {"position": [], "mean": [], "low": [], "high": [], "groups": []}
    for i in range(max((len(s) for s in series), default=0)):
        values = [s[i] for s in series if i < len(s) and s[i] is not None]
        if len(values) < least:
            break
        mean = sum(values) / len(values)
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        half = Z95 * sd / math.sqrt(len(values))
        out["position"].append(first + i)
        out["mean"].append(round(mean, 6))
        out["low"].append(round(mean - half, 6))
        out["high"].append(round(mean + half, 6))
        out["groups"].append(len(values))
    return out if out["position"] else None


def windows(c: dict | None) -> dict | None:
    """The curve's mean over positions 0..WINDOW−1 and over the positions after them (None where
    the curve has none)."""
    if c is None:
        return None

    def mean(keep) -> float | None:
        values = [m for p, m in zip(c["position"], c["mean"]) if keep(p)]
        return round(sum(values) / len(values), 6) if values else None

    return {"first": mean(lambda p: 0 <= p < WINDOW), "rest": mean(lambda p: p >= WINDOW)}


def analyse(records: Mapping[str, Sequence[dict]]) -> dict[str, dict]:
    """{arm: its curves} for the arms whose groups recorded a loss or a novelty (``records``:
    arm → its groups' records, in problem order). Each arm has ``loss`` and ``novelty`` (a
    ``curve`` or None), the ``windows`` of both, and how many groups gave each."""
    out: dict[str, dict] = {}
    for arm, recs in records.items():
        losses = [r["loss"] for r in recs if r.get("loss")]
        novelty = [r["novelty"]["mean"] for r in recs if r.get("novelty")]
        if not losses and not novelty:
            continue
        loss_curve = curve(losses, first=-1)
        novelty_curve = curve(novelty, first=0)
        out[arm] = {
            "groups": {"loss": len(losses), "novelty": len(novelty)},
            "loss": loss_curve,
            "novelty": novelty_curve,
            "windows": {"loss": windows(loss_curve), "novelty": windows(novelty_curve)},
        }
    return out
