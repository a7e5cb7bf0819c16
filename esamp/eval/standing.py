"""What the committed frontier runs measured for a model: where ESamp stands against sampling
hotter or colder, for clients that tell the user (the dashboard's compare row and help).

The one source of every figure is the run's own ``report.json`` under ``benchmarks/results``
(made by ``esamp eval`` with plain arms; what "above the curve" means:
docs/eval.md, "The frontier: ESamp against the temperature curve"); nothing here restates a
number. Outside a checkout (no ``benchmarks``
folder) nothing is known and callers show nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from esamp.core.config import EsampConfig, Steering
from esamp.engines.models import EMBEDDED_NAME

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# model name (as the engine reports it) -> its frontier run, a folder under RESULTS
FRONTIER_RUNS = {
    EMBEDDED_NAME: "eval-cpu-frontier/arith",
    # the packaged name (engines.models.PACKAGED); the run in the completion frame, which esamp eval
    # gives a model without a chat template (the earlier folder measured continuations of the bare problem)
    "gemma3-270m": "eval-gpu-frontier-gemma3-270m-framed/arith",
}
STEERING_KEYS = tuple(k for k in Steering.model_fields if k != "enabled")


@dataclass(frozen=True)
class Standing:
    """One ESamp cell of a committed run: its ΔVendi against the baseline and its pass@1 gap to
    the temperature curve, each with a 95% interval."""

    model: str
    source: str  # the run folder, relative to the repository
    task: str
    problems: int
    n: int
    cell: str
    vendi: dict  # delta, low, high
    gap: dict  # gap, low, high, verdict (esamp.eval.frontier)
    metric: str

    @property
    def diversity(self) -> str:
        """narrows, widens or unchanged: ΔVendi's interval below, above or around 0."""
        v = self.vendi
        return "narrows" if v["high"] < 0 else "widens" if v["low"] > 0 else "unchanged"

    @property
    def diversity_words(self) -> str:
        return {
            "narrows": "narrows the samples",
            "widens": "widens the samples",
            "unchanged": "leaves the samples' diversity unchanged within noise",
        }[self.diversity]

    @property
    def accuracy_words(self) -> str:
        return {
            "above": f"beats plain sampling on {self.metric} at the same diversity",
            "below": f"is less accurate ({self.metric}) than plain sampling at the same diversity",
            "on": f"is no more accurate ({self.metric}) than plain sampling at the same diversity",
        }.get(self.gap["verdict"], "lies beyond the diversity the temperature curve covers")

    def short(self) -> str:
        """One line for a row header."""
        where = {"above": "above", "below": "below", "on": "on"}.get(self.gap["verdict"], "beyond")
        change = {"narrows": "narrower", "widens": "wider", "unchanged": "no change beyond noise"}[self.diversity]
        against = (
            f"{self.metric} {where} the temperature curve ({_interval(self.gap, 'gap')})"
            if where != "beyond"
            else "beyond the temperature curve's diversity"
        )
        return f"measured on {self.task}: Vendi {_interval(self.vendi, 'delta')} ({change}), {against}; ? for more"

    def text(self) -> str:
        """A paragraph for the help screen."""
        return (
            f"Measured on {self.model} ({self.task}, {self.problems} problems, n = {self.n}, "
            f"{self.source}): ESamp with these settings {self.diversity_words} (Vendi "
            f"{_interval(self.vendi, 'delta')} against plain sampling at the same temperature) and "
            + (
                f"{self.accuracy_words} ({_interval(self.gap, 'gap')} against the temperature curve). "
                if self.gap["verdict"] in ("above", "below", "on")
                else f"{self.accuracy_words}, so the run cannot compare its accuracy with plain sampling's. "
            )
            + (
                "So on this model, sampling hotter or colder without ESamp does at least as well."
                if self.gap["verdict"] in ("below", "on")
                else ""
            )
        ).strip()


def _interval(d: dict, key: str) -> str:
    if any(math.isnan(d[k]) for k in (key, "low", "high")):
        return "n/a"
    return f"{d[key]:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]".replace("-", "−")


def _differs(settings: dict, engine: dict) -> int:
    """How many engine-wide settings of a cell differ from ``engine``'s."""
    return sum(settings.get(k, v) != v for k, v in engine.items())


def standing(
    model: str | None, steering: Steering, results: Path | None = None, config: EsampConfig | None = None
) -> Standing | None:
    """The committed run's figures for ``model`` and the cell with ``steering``'s settings, or
    None (no run for the model, no such cell, no frontier, or no checkout). Of cells that share the
    steering, the one whose engine-wide settings (the Distiller's mode, rank, ...) are ``config``'s,
    or the fewest apart from them (default: the engine's defaults)."""
    run = FRONTIER_RUNS.get(model or "")
    if run is None or not steering.enabled:
        return None
    try:
        report = json.loads(((results or RESULTS) / run / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    front = report.get("frontier")
    if not front or not front.get("gaps"):
        return None
    want = {k: getattr(steering, k) for k in STEERING_KEYS}
    cells = [name for name, c in report["cells"].items() if {k: c["settings"].get(k) for k in STEERING_KEYS} == want]
    if not cells:
        return None
    # Cells may share a steering and differ in engine-wide settings (the Gemma run has the paper mix
    # with a Distiller per group and with the shared one): the engine's own settings come first.
    engine = (config or EsampConfig()).model_dump(exclude={"steering"})
    cell = min(cells, key=lambda name: _differs(report["cells"][name]["settings"], engine))
    metric = next(iter(front["gaps"]))  # pass@1: the accuracy of one sample
    gap, vendi = front["gaps"][metric][cell], report["cells"][cell]["deltas"]["vendi"]
    if any(math.isnan(x) for x in (vendi["delta"], vendi["low"], vendi["high"])):
        return None
    return Standing(
        model=model,
        source=f"benchmarks/results/{run}",
        task=report["task"],
        problems=front["problems"],
        n=report["settings"]["n"],
        cell=cell,
        vendi=vendi,
        gap=gap,
        metric=metric,
    )
