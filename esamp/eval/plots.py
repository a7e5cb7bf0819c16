"""The report's plots: PNG files (matplotlib, headless) and the same views in the terminal (plotext).

Three views per task, each drawn from a task summary (``esamp.eval.report.summarize``):

- ``passk``: pass@k against k, one line per arm, the baseline in black;
- ``plane``: each cell's Δpass@k (largest k) against its ΔVendi with both 95% intervals, so a
  cell up and to the right improves quality and diversity at once (tasks without answers: Δ
  distinct-2 against ΔVendi, both diversity);
- ``shifts``: per-problem movement. Graded tasks: per cell, the problems whose correct count
  rose or fell, the darker part those that went from 0/n to at least 1/n (or back), and beside
  it each problem's change in correct samples. Tasks without answers: each prompt's ΔVendi.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Sequence

from esamp.eval.matrix import BASELINE
from esamp.eval.report import arm_label, metric_name

DPI = 110


def _pass_keys(summary: dict) -> list[str]:
    return [f"pass@{k}" for k in summary["settings"]["ks"] if f"pass@{k}" in summary["arms"][BASELINE]]


def _plane_metrics(summary: dict) -> tuple[str, str] | None:
    """(x, y) metrics of the quality–diversity plane, or None when the task lacks them."""
    base = summary["arms"][BASELINE]
    passes = _pass_keys(summary)
    if "vendi" not in base:
        return None
    if passes:
        return "vendi", passes[-1]
    return ("vendi", "distinct_2") if "distinct_2" in base else None


def _colours(count: int):
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if count <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(count)]


def write_plots(summaries: Sequence[dict], folder: Path) -> tuple[dict[str, dict[str, str]], str | None]:
    """Write each task's PNGs into ``folder``; returns ({task: {view: file name}}, a reason when
    no plot could be drawn)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # headless: no display is needed or touched
        import matplotlib.pyplot as plt
    except ImportError:
        return {}, "matplotlib is not installed: pip install 'esamp[eval]'"
    images: dict[str, dict[str, str]] = {}
    for summary in summaries:
        task = summary["task"]
        mine: dict[str, str] = {}
        for view, draw in (("passk", _passk), ("plane", _plane), ("shifts", _shifts)):
            fig = draw(plt, summary)
            if fig is None:
                continue
            name = f"{task}-{view}.png"
            fig.savefig(folder / name, dpi=DPI, bbox_inches="tight")
            plt.close(fig)
            mine[view] = name
        images[task] = mine
    return images, None


def _title(summary: dict, what: str) -> str:
    p = summary["problems"]
    return f"{summary['task']}: {what} (n = {summary['settings']['n']}, {p['finished']} problems)"


def _passk(plt, summary: dict):
    keys = _pass_keys(summary)
    if not keys:
        return None
    ks = [int(k.split("@")[1]) for k in keys]
    arms = summary["arms"]
    cells = list(summary["cells"])
    fig, ax = plt.subplots(figsize=(8.5, 5))
    ax.plot(ks, [arms[BASELINE][k] for k in keys], color="black", linewidth=2.6, marker="o",
            label="baseline", zorder=5)
    for colour, cell in zip(_colours(len(cells)), cells):
        ax.plot(ks, [arms[cell][k] for k in keys], color=colour, linewidth=1.6, marker="o",
                markersize=4, label=arm_label(cell))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    top = max(arms[a][k] for a in arms for k in keys)
    ax.set_ylim(0, min(1.0, top + 0.08))
    ax.set_xlabel("k (samples drawn of n)")
    ax.set_ylabel("pass@k (mean over problems)")
    ax.grid(True, alpha=0.3)
    ax.set_title(_title(summary, "pass@k against k"))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def _plane(plt, summary: dict):
    metrics = _plane_metrics(summary)
    if metrics is None:
        return None
    x_key, y_key = metrics
    cells = list(summary["cells"])
    fig, ax = plt.subplots(figsize=(8.5, 6))
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.axvline(0, color="grey", linewidth=0.8)
    xs, ys = [], []
    for number, (colour, cell) in enumerate(zip(_colours(len(cells)), cells), start=1):
        dx, dy = summary["cells"][cell]["deltas"][x_key], summary["cells"][cell]["deltas"][y_key]
        ax.errorbar(dx["delta"], dy["delta"],
                    xerr=[[dx["delta"] - dx["low"]], [dx["high"] - dx["delta"]]],
                    yerr=[[dy["delta"] - dy["low"]], [dy["high"] - dy["delta"]]],
                    fmt="o", color=colour, ecolor=colour, elinewidth=1.2, capsize=3, alpha=0.85,
                    label=f"{number}  {arm_label(cell)}")
        ax.annotate(str(number), (dx["delta"], dy["delta"]), textcoords="offset points", xytext=(4, 4),
                    fontsize=9, fontweight="bold", color=colour)
        xs += [dx["low"], dx["high"]]
        ys += [dy["low"], dy["high"]]
    # Symmetric limits keep the quadrants the same size, so "up and to the right" reads at a glance.
    span_x = max([abs(v) for v in xs if not math.isnan(v)] + [1e-3]) * 1.15
    span_y = max([abs(v) for v in ys if not math.isnan(v)] + [1e-3]) * 1.15
    ax.set_xlim(-span_x, span_x)
    ax.set_ylim(-span_y, span_y)
    graded = y_key.startswith("pass@")
    ax.fill_between([0, span_x], 0, span_y, color="tab:green", alpha=0.07, zorder=0)
    ax.text(span_x * 0.97, span_y * 0.95, "helps on both" if graded else "more diverse by both",
            ha="right", va="top", fontsize=8, color="tab:green")
    ax.fill_between([-span_x, 0], -span_y, 0, color="tab:red", alpha=0.05, zorder=0)
    ax.text(-span_x * 0.97, -span_y * 0.95, "worse on both" if graded else "less diverse by both",
            ha="left", va="bottom", fontsize=8, color="tab:red")
    ax.set_xlabel(f"Δ {metric_name(x_key)} (cell − baseline; more different samples →)")
    ax.set_ylabel(f"Δ {metric_name(y_key)} (cell − baseline)")
    what = "quality against diversity" if graded else "diversity by two measures"
    ax.set_title(_title(summary, what) + "\nbars: 95% paired bootstrap intervals", fontsize=10)
    ax.grid(True, alpha=0.25)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def _shifts(plt, summary: dict):
    cells = list(summary["cells"])
    rows = summary["per_problem"]
    graded = [r for r in rows if r[BASELINE]["correct"] is not None]
    n = summary["settings"]["n"]
    if graded:
        ids = [r["id"] for r in graded]
        change = [[r[c]["correct"] - r[BASELINE]["correct"] for c in cells] for r in graded]
        label = "Δ correct samples (of n)"
    else:
        diverse = [r for r in rows if r[BASELINE]["diversity"]]
        if not diverse:
            return None
        ids = [r["id"] for r in diverse]
        change = [[r[c]["diversity"]["vendi"] - r[BASELINE]["diversity"]["vendi"] for c in cells] for r in diverse]
        label = "Δ Vendi"
    height = max(4.5, 0.2 * len(ids) + 1.5)
    labels = [arm_label(c) for c in cells]
    if graded:
        fig, (bars, heat) = plt.subplots(1, 2, figsize=(13, height), gridspec_kw={"width_ratios": [1, 1.2]})
        x = list(range(len(cells)))
        sh = [summary["cells"][c]["shifts"] for c in cells]
        gained = [s["gained"] for s in sh]
        lost = [s["lost"] for s in sh]
        bars.bar(x, gained, color="tab:green", label=f"0/{n} → ≥1/{n} (solved now)")
        bars.bar(x, [s["up"] - s["gained"] for s in sh], bottom=gained, color="tab:green", alpha=0.4,
                 label="more correct samples")
        bars.bar(x, [-s for s in lost], color="tab:red", label=f"≥1/{n} → 0/{n} (no longer solved)")
        bars.bar(x, [-(s["down"] - s["lost"]) for s in sh], bottom=[-s for s in lost], color="tab:red",
                 alpha=0.4, label="fewer correct samples")
        bars.axhline(0, color="black", linewidth=0.8)
        bars.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
        bars.set_ylabel("problems (up: improved, down: worse)")
        bars.set_title("problems that moved, per cell", fontsize=10)
        bars.margins(y=0.12)
        bars.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.26), ncol=2, frameon=False)
        bars.grid(True, axis="y", alpha=0.3)
    else:
        fig, heat = plt.subplots(figsize=(max(6, 1.1 * len(cells) + 3), height))
    # The colour scale spans the largest change seen, so small moves stay visible.
    limit = max([abs(v) for row in change for v in row] + [1 if graded else 1e-3])
    image = heat.imshow(change, cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
    if graded and len(ids) * len(cells) <= 600:
        for i, row in enumerate(change):
            for j, v in enumerate(row):
                if v:
                    heat.text(j, i, f"{v:+d}", ha="center", va="center", fontsize=6,
                              color="white" if abs(v) > limit * 0.6 else "black")
    heat.set_yticks(range(len(ids)), ids, fontsize=6)
    heat.set_xticks(range(len(cells)), labels, rotation=45, ha="right", fontsize=8)
    heat.set_title(f"{label} per problem, cell − baseline", fontsize=10)
    fig.colorbar(image, ax=heat, fraction=0.046, pad=0.04, label=label)
    fig.suptitle(_title(summary, "per-problem shifts"), fontsize=11)
    fig.tight_layout()
    return fig


# -- the terminal ----------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _mark(index: int) -> str:
    """The character that draws cell ``index`` (0-based) in the terminal: 1-9, then A-Z."""
    return "123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"[index % 35]


def terminal_charts(summaries: Sequence[dict], colour: bool = True, width: int | None = None) -> str:
    """pass@k against k and the quality–diversity plane of each task, drawn with plotext.

    Each cell is drawn with its own character (b for the baseline, then 1, 2, ...) and the key
    is printed under the charts, so they read without colour too.
    """
    import shutil

    import plotext as plx

    width = width or min(110, shutil.get_terminal_size((100, 30)).columns)
    parts = []
    for summary in summaries:
        cells = list(summary["cells"])
        keys = _pass_keys(summary)
        if keys:
            plx.clear_figure()
            plx.plotsize(width, 20)
            ks = [int(k.split("@")[1]) for k in keys]
            xs = [math.log2(k) for k in ks]
            for index, arm in enumerate([BASELINE] + cells):
                plx.plot(xs, [summary["arms"][arm][k] for k in keys], marker="b" if index == 0 else _mark(index - 1))
            plx.xticks(xs, [str(k) for k in ks])
            plx.xlabel("k")
            plx.title(_title(summary, "pass@k against k"))
            parts.append(plx.build())
        metrics = _plane_metrics(summary)
        if metrics:
            x_key, y_key = metrics
            plx.clear_figure()
            plx.plotsize(width, 20)
            deltas = [summary["cells"][c]["deltas"] for c in cells]
            span_x = max([abs(d[x_key]["delta"]) for d in deltas] + [1e-3]) * 1.2
            span_y = max([abs(d[y_key]["delta"]) for d in deltas] + [1e-3]) * 1.2
            plx.xlim(-span_x, span_x)
            plx.ylim(-span_y, span_y)
            plx.vline(0)
            plx.hline(0)
            for index, d in enumerate(deltas):
                plx.scatter([d[x_key]["delta"]], [d[y_key]["delta"]], marker=_mark(index))
            plx.xlabel(f"Δ {metric_name(x_key)}")
            plx.title(f"{summary['task']}: Δ{metric_name(y_key)} (up) against ΔVendi (right); "
                      "up and to the right helps")
            parts.append(plx.build())
        key = "   ".join(f"{_mark(i)} = {arm_label(c)}" for i, c in enumerate(cells))
        parts.append(f"b = baseline   {key}\n")
    plx.clear_figure()
    text = "\n".join(parts)
    return text if colour else _ANSI.sub("", text)
