"""Which way is better for each metric the eval reports, and how a report marks a change.

A change whose 95% interval excludes 0 is a *gain* when it moves the metric the better way and a
*loss* when it moves it the other way. The Markdown report (``esamp.eval.report``) writes such a
change in bold with a mark inside the bold, ▲ for a gain and ▼ for a loss, so the direction reads
without colour; the HTML report (``esamp.eval.html``) colours a marked span by its mark, and
leaves every other bold span (headings of a sentence, an interval that holds 0) uncoloured.
"""

from __future__ import annotations

import math

HIGHER, LOWER = "higher", "lower"
GAIN, LOSS = "gain", "loss"
MARKS = {GAIN: "▲", LOSS: "▼"}

# metric -> which way is better. pass@k: more problems solved. The diversity measures (Vendi, mean
# pairwise cosine distance, distinct-n): more different samples, what ESamp is for. A frontier gap
# is a pass@k difference at equal Vendi and reads as its pass@k does.
BETTER = {
    "pass@k": HIGHER,
    "vendi": HIGHER,
    "cosine_distance": HIGHER,
    "distinct_1": HIGHER,
    "distinct_2": HIGHER,
}


def better(metric: str) -> str:
    """HIGHER or LOWER: which way ``metric`` (a summary key: ``pass@4``, ``vendi``, ...) improves.
    A metric missing from ``BETTER`` is an error, so a new metric cannot be coloured by default."""
    key = "pass@k" if metric.startswith("pass@") else metric
    if key not in BETTER:
        raise KeyError(f"no better direction for metric {metric!r}: add it to BETTER in {__name__}")
    return BETTER[key]


def change(metric: str, low: float, high: float) -> str | None:
    """GAIN or LOSS for a change of ``metric`` with the interval [low, high]; None when the interval
    holds 0 (or is not a number): no direction is claimed."""
    if math.isnan(low) or math.isnan(high) or low <= 0 <= high:
        return None
    up = low > 0
    return GAIN if up == (better(metric) == HIGHER) else LOSS


def lower_is_better() -> list[str]:
    """The metrics that improve by going down, for a report's legend."""
    return [m for m, way in BETTER.items() if way == LOWER]
