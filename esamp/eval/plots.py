"""The report's plots: PNG files (matplotlib, headless) and the same views in the terminal (plotext).

Three views per task, each drawn from a task summary (``esamp.eval.report.summarize``):

- ``passk``: pass@k against k, one line per arm, the baseline in black;
- ``plane``: each cell's Δpass@k (largest k) against its ΔVendi with both 95% intervals, so a
  cell up and to the right improves quality and diversity at once (tasks without answers: Δ
  distinct-2 against ΔVendi, both diversity);
- ``frontier`` (with plain arms at other temperatures): pass@1 and pass@k against Vendi, the
  temperature curve as a black line, every other plain arm in grey, every cell a coloured point,
  all with 95% intervals on both axes; a cell above the line beats raising the temperature
  (tasks without answers: Vendi against temperature, each cell at the temperature as diverse);
- ``shifts``: per-problem movement. Graded tasks: per cell, the problems whose correct count
  rose or fell, the darker part those that went from 0/n to at least 1/n (or back), and beside
  it each problem's change in correct samples. Tasks without answers: each prompt's ΔVendi;
- ``learning`` (when the records hold the Distiller's traces): each ESamp arm's mean Distiller
  loss (left) and its tokens' mean novelty (right) against token position, with 95% bands
  (``esamp.eval.learning`` computes the curves; this only draws them).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

from esamp.eval.matrix import BASELINE
from esamp.eval.report import arm_label, metric_name

DPI = 110
VIEWS = ("passk", "plane", "frontier", "shifts", "learning")  # in the order they are drawn
VERDICT_LEGEND = {
    "above": "above the curve",
    "below": "below the curve",
    "on": "on the curve",
    "outside": "at or beyond the curve's end",
}


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
    draws = {"passk": _passk, "plane": _plane, "frontier": _frontier, "shifts": _shifts, "learning": _learning}
    for summary in summaries:
        task = summary["task"]
        mine: dict[str, str] = {}
        for view in VIEWS:
            fig = draws[view](plt, summary)
            if fig is None:
                continue
            name = plot_name(task, view)
            fig.savefig(folder / name, dpi=DPI, bbox_inches="tight")
            plt.close(fig)
            mine[view] = name
        images[task] = mine
    return images, None


def plot_name(task: str, view: str) -> str:
    """The PNG file of one task's view."""
    return f"{task}-{view}.png"


def existing_plots(summaries: Sequence[dict], folder: Path) -> dict[str, dict[str, str]]:
    """{task: {view: file name}} of the PNGs ``write_plots`` left in ``folder`` for these tasks,
    for a report rendered again without drawing them again."""
    return {
        s["task"]: {
            view: plot_name(s["task"], view) for view in VIEWS if (folder / plot_name(s["task"], view)).is_file()
        }
        for s in summaries
    }


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
    ax.plot(ks, [arms[BASELINE][k] for k in keys], color="black", linewidth=2.6, marker="o", label="baseline", zorder=5)
    for colour, cell in zip(_colours(len(cells)), cells):
        ax.plot(
            ks,
            [arms[cell][k] for k in keys],
            color=colour,
            linewidth=1.6,
            marker="o",
            markersize=4,
            label=arm_label(cell),
        )
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
        ax.errorbar(
            dx["delta"],
            dy["delta"],
            xerr=[[dx["delta"] - dx["low"]], [dx["high"] - dx["delta"]]],
            yerr=[[dy["delta"] - dy["low"]], [dy["high"] - dy["delta"]]],
            fmt="o",
            color=colour,
            ecolor=colour,
            elinewidth=1.2,
            capsize=3,
            alpha=0.85,
            label=f"{number}  {arm_label(cell)}",
        )
        ax.annotate(
            str(number),
            (dx["delta"], dy["delta"]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=9,
            fontweight="bold",
            color=colour,
        )
        xs += [dx["low"], dx["high"]]
        ys += [dy["low"], dy["high"]]
    # Symmetric limits keep the quadrants the same size, so "up and to the right" reads at a glance.
    span_x = max([abs(v) for v in xs if not math.isnan(v)] + [1e-3]) * 1.15
    span_y = max([abs(v) for v in ys if not math.isnan(v)] + [1e-3]) * 1.15
    ax.set_xlim(-span_x, span_x)
    ax.set_ylim(-span_y, span_y)
    graded = y_key.startswith("pass@")
    ax.fill_between([0, span_x], 0, span_y, color="tab:green", alpha=0.07, zorder=0)
    ax.text(
        span_x * 0.97,
        span_y * 0.95,
        "helps on both" if graded else "more diverse by both",
        ha="right",
        va="top",
        fontsize=8,
        color="tab:green",
    )
    ax.fill_between([-span_x, 0], -span_y, 0, color="tab:red", alpha=0.05, zorder=0)
    ax.text(
        -span_x * 0.97,
        -span_y * 0.95,
        "worse on both" if graded else "less diverse by both",
        ha="left",
        va="bottom",
        fontsize=8,
        color="tab:red",
    )
    ax.set_xlabel(f"Δ {metric_name(x_key)} (cell − baseline; more different samples →)")
    ax.set_ylabel(f"Δ {metric_name(y_key)} (cell − baseline)")
    what = "quality against diversity" if graded else "diversity by two measures"
    ax.set_title(_title(summary, what) + "\nbars: 95% paired bootstrap intervals", fontsize=10)
    ax.grid(True, alpha=0.25)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def _errorbar(ax, x: dict, y: dict, **style) -> None:
    ax.errorbar(
        x["mean"],
        y["mean"],
        xerr=[[x["mean"] - x["low"]], [x["high"] - x["mean"]]],
        yerr=[[y["mean"] - y["low"]], [y["high"] - y["mean"]]],
        capsize=3,
        elinewidth=1,
        **style,
    )


def _frontier(plt, summary: dict):
    front = summary.get("frontier")
    if not front:
        return None
    metrics = list(front["gaps"])
    points = front["points"]
    curve = front["curve"]
    cells = list(summary["cells"])
    others = [a for a in summary["settings"].get("plain", {}) if a not in curve]
    colours = _colours(len(cells))
    if not metrics:  # no answers: Vendi against temperature
        fig, ax = plt.subplots(figsize=(8.5, 5))
        temps = [front["temperatures"][a] for a in curve]
        vendi = {a: points[a]["vendi"] for a in points}
        ax.plot(
            temps,
            [vendi[a]["mean"] for a in curve],
            color="black",
            linewidth=2,
            marker="o",
            label="plain sampling (the temperature curve)",
            zorder=5,
        )
        for t, a in zip(temps, curve):
            ax.errorbar(
                t,
                vendi[a]["mean"],
                yerr=[[vendi[a]["mean"] - vendi[a]["low"]], [vendi[a]["high"] - vendi[a]["mean"]]],
                color="black",
                capsize=3,
            )
        base_t = summary["settings"]["temperature"]
        for colour, cell in zip(colours, cells):
            v = vendi[cell]
            ax.errorbar(
                base_t,
                v["mean"],
                yerr=[[v["mean"] - v["low"]], [v["high"] - v["mean"]]],
                fmt="s",
                color=colour,
                capsize=3,
                label=arm_label(cell),
                zorder=6,
            )
            equal = front["temperature_equivalent"].get(cell)
            if equal is not None:
                ax.plot([base_t, equal], [v["mean"], v["mean"]], color=colour, linestyle=":", linewidth=1.2)
        for arm in others:
            v = vendi[arm]
            t = summary["settings"]["plain"][arm].get("temperature", base_t)
            ax.errorbar(
                t,
                v["mean"],
                yerr=[[v["mean"] - v["low"]], [v["high"] - v["mean"]]],
                fmt="D",
                color="grey",
                capsize=3,
                label=f"plain {arm}",
            )
        ax.set_xlabel("temperature (cells at their own; dotted: the temperature as diverse)")
        ax.set_ylabel("Vendi (effective distinct replies of n)")
        ax.grid(True, alpha=0.3)
        ax.set_title(_title(summary, "diversity against temperature") + "\nbars: 95% bootstrap intervals", fontsize=10)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        return fig
    fig, axes = plt.subplots(1, len(metrics), figsize=(7 * len(metrics) + 2.5, 5.5), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        xs = [points[a]["vendi"]["mean"] for a in curve]
        ax.plot(
            xs,
            [points[a][metric]["mean"] for a in curve],
            color="black",
            linewidth=2,
            zorder=5,
            label="plain sampling (the temperature curve)",
        )
        for a in curve:
            _errorbar(ax, points[a]["vendi"], points[a][metric], fmt="o", color="black", zorder=5)
            ax.annotate(
                f"T {front['temperatures'][a]:g}",
                (points[a]["vendi"]["mean"], points[a][metric]["mean"]),
                textcoords="offset points",
                xytext=(5, -11),
                fontsize=8,
            )
        for arm in others:
            _errorbar(
                ax, points[arm]["vendi"], points[arm][metric], fmt="D", color="grey", alpha=0.8, label=f"plain {arm}"
            )
        for number, (colour, cell) in enumerate(zip(colours, cells), start=1):
            verdict = VERDICT_LEGEND[front["gaps"][metric][cell]["verdict"]]
            _errorbar(
                ax,
                points[cell]["vendi"],
                points[cell][metric],
                fmt="s",
                color=colour,
                alpha=0.9,
                zorder=6,
                label=f"{number}  {arm_label(cell)} ({verdict})",
            )
            ax.annotate(
                str(number),
                (points[cell]["vendi"]["mean"], points[cell][metric]["mean"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=9,
                fontweight="bold",
                color=colour,
            )
        ax.set_xlabel("Vendi (more different replies →)")
        ax.set_ylabel(f"{metric} (mean over problems)")
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{metric} against Vendi", fontsize=10)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=7, frameon=False, ncol=2)
    fig.suptitle(
        _title(summary, "ESamp against the temperature curve")
        + "\nabove the black line beats sampling hotter or colder; bars: 95% intervals of each mean; "
        "verdicts (legend): the paired interval of the gap to the line",
        fontsize=10,
    )
    fig.tight_layout()
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
        bars.bar(
            x,
            [s["up"] - s["gained"] for s in sh],
            bottom=gained,
            color="tab:green",
            alpha=0.4,
            label="more correct samples",
        )
        bars.bar(x, [-s for s in lost], color="tab:red", label=f"≥1/{n} → 0/{n} (no longer solved)")
        bars.bar(
            x,
            [-(s["down"] - s["lost"]) for s in sh],
            bottom=[-s for s in lost],
            color="tab:red",
            alpha=0.4,
            label="fewer correct samples",
        )
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
                    heat.text(
                        j,
                        i,
                        f"{v:+d}",
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white" if abs(v) > limit * 0.6 else "black",
                    )
    heat.set_yticks(range(len(ids)), ids, fontsize=6)
    heat.set_xticks(range(len(cells)), labels, rotation=45, ha="right", fontsize=8)
    heat.set_title(f"{label} per problem, cell − baseline", fontsize=10)
    fig.colorbar(image, ax=heat, fraction=0.046, pad=0.04, label=label)
    fig.suptitle(_title(summary, "per-problem shifts"), fontsize=11)
    fig.tight_layout()
    return fig


def _learning(plt, summary: dict):
    learned = summary.get("learning")
    if not learned:
        return None
    arms = list(learned)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for colour, arm in zip(_colours(len(arms)), arms):
        for ax, key in ((left, "loss"), (right, "novelty")):
            c = learned[arm][key]
            if c is None:
                continue
            ax.plot(c["position"], c["mean"], color=colour, linewidth=1.6, label=arm_label(arm))
            ax.fill_between(c["position"], c["low"], c["high"], color=colour, alpha=0.18, linewidth=0)
    right.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
    left.set_ylabel("Distiller loss (mean squared error)")
    right.set_ylabel("novelty (0.5: as surprising as the group's recent tokens)")
    left.set_title("Distiller loss of the step whose inputs were the tokens at p", fontsize=10)
    right.set_title("mean novelty of the tokens at p", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel("token position p in the reply (−1: the prompt's last token)")
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=8, frameon=False)
    fig.suptitle(
        _title(summary, "does the Distiller learn within a group?")
        + "\nmean over the arm's groups, bands: 95% intervals of the mean",
        fontsize=10,
    )
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
            plx.title(
                f"{summary['task']}: Δ{metric_name(y_key)} (up) against ΔVendi (right); up and to the right helps"
            )
            parts.append(plx.build())
        key = "   ".join(f"{_mark(i)} = {arm_label(c)}" for i, c in enumerate(cells))
        parts.append(f"b = baseline   {key}\n")
    plx.clear_figure()
    text = "\n".join(parts)
    return text if colour else _ANSI.sub("", text)
