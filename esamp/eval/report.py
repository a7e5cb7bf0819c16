"""Turn the records of a finished run into numbers, a JSON file and a Markdown report.

Everything here is a pure function of the records and settings (the bootstrap is seeded), so a
resumed run reports exactly what an uninterrupted one would.

A task's summary (``summarize``) holds every arm's metrics, and for each cell its deltas against
the baseline (cell minus baseline, paired bootstrap over problems) and its per-problem shifts.
With one cell, ``deltas`` also sits at the top of the summary, the shape of single-cell reports.
With plain arms at other temperatures, ``frontier`` says where every cell stands against the
temperature curve (``esamp.eval.frontier``). ``learning`` holds, per ESamp arm, its Distiller's
loss and its tokens' novelty against token position (``esamp.eval.learning``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from esamp.eval import direction, frontier as frontier_lib, learning as learning_lib
from esamp.eval.matrix import BASELINE, SINGLE, format_value
from esamp.eval.passk import pass_at_k
from esamp.eval.prompts import describe_record
from esamp.eval.runner import EvalSettings
from esamp.eval.stats import paired_bootstrap
from esamp.eval.tasks import Problem

DIVERSITY_KEYS = ("vendi", "cosine_distance", "distinct_1", "distinct_2")
METRIC_NAMES = {
    "vendi": "Vendi",
    "cosine_distance": "cosine distance",
    "distinct_1": "distinct-1",
    "distinct_2": "distinct-2",
}


def metric_name(metric: str) -> str:
    return METRIC_NAMES.get(metric, metric)


def arm_label(arm: str) -> str:
    return "ESamp" if arm == SINGLE else arm


# -- numbers ---------------------------------------------------------------------------------


def shifts(graded: Sequence[Problem], records, arm: str) -> dict:
    """How the problems' correct counts moved from the baseline to ``arm``."""
    out = {"up": 0, "down": 0, "gained": 0, "lost": 0, "same": 0}
    for p in graded:
        b, e = records[(p.id, BASELINE)]["correct"], records[(p.id, arm)]["correct"]
        out["up" if e > b else "down" if e < b else "same"] += 1
        out["gained"] += b == 0 and e > 0
        out["lost"] += b > 0 and e == 0
    return out


def summarize(
    problems: Sequence[Problem], records: dict[tuple[str, str], dict], settings: EvalSettings, resamples: int = 10_000
) -> dict:
    """Per-arm metrics, each cell's deltas against the baseline with paired bootstrap intervals,
    and the per-problem table. Only problems that every arm finished count."""
    arms = settings.arms
    both = [p for p in problems if all((p.id, arm) in records for arm in arms)]
    graded = [p for p in both if records[(p.id, BASELINE)]["correct"] is not None]
    diverse = [p for p in both if records[(p.id, BASELINE)].get("diversity")]
    n = settings.n

    per_arm: dict[str, dict] = {}
    series: dict[str, dict[str, list[float]]] = {}  # metric -> arm -> per-problem values
    for arm in arms:
        recs = [records[(p.id, arm)] for p in both]
        info: dict = {
            "samples": sum(len(r["texts"]) for r in recs),
            "tokens": sum(sum(r["tokens"]) for r in recs),
            "seconds": round(sum(r["seconds"] for r in recs), 2),
            "stopped_by_length": sum(f == "length" for r in recs for f in r["finish"]),
        }
        info["tokens_per_s"] = round(info["tokens"] / info["seconds"], 2) if info["seconds"] else 0.0
        if graded:
            correct = [records[(p.id, arm)]["correct"] for p in graded]
            info["correct"] = sum(correct)
            info["graded_samples"] = n * len(graded)
            info["solved_any"] = sum(c > 0 for c in correct)
            for k in settings.ks:
                values = [pass_at_k(n, c, k) for c in correct]
                series.setdefault(f"pass@{k}", {})[arm] = values
                info[f"pass@{k}"] = sum(values) / len(values)
        for key in DIVERSITY_KEYS:
            if diverse:
                values = [records[(p.id, arm)]["diversity"][key] for p in diverse]
                series.setdefault(key, {})[arm] = values
                info[key] = sum(values) / len(values)
        per_arm[arm] = info

    cells = {}
    for cell in settings.cells:
        cells[cell.name] = {
            "settings": cell.record(),
            "deltas": {
                metric: paired_bootstrap(
                    by_arm[BASELINE], by_arm[cell.name], resamples=resamples, seed=settings.seed
                ).to_dict()
                for metric, by_arm in series.items()
            },
            "shifts": shifts(graded, records, cell.name) if graded else None,
        }

    rows = []
    for p in both:
        row = {"id": p.id, "kind": p.kind}
        for arm in arms:
            r = records[(p.id, arm)]
            row[arm] = {"correct": r["correct"], "tokens": sum(r["tokens"]), "diversity": r.get("diversity")}
        rows.append(row)
    summary = {
        "task": settings.task,
        "settings": settings.to_dict(),
        "problems": {
            "asked": len(problems),
            "finished": len(both),
            "graded": len(graded),
            "with_diversity": len(diverse),
        },
        "arms": per_arm,
        "cells": cells,
        "per_problem": rows,
    }
    if len(cells) == 1:
        summary["deltas"] = next(iter(cells.values()))["deltas"]
    front = frontier(settings, both, records, resamples)
    if front is not None:
        summary["frontier"] = front
    learned = learning_lib.analyse({arm: [records[(p.id, arm)] for p in both] for arm in arms})
    if learned:
        summary["learning"] = learned
    return summary


def curve_temperatures(settings: EvalSettings) -> dict[str, float]:
    """The arms of the temperature curve and their temperatures: the baseline and the plain arms
    that differ from it in temperature only."""
    base = settings.base_sampling
    curve = {BASELINE: base.temperature}
    for arm in settings.plain:
        own = arm.sampling(base)
        if own.model_copy(update={"temperature": base.temperature}) == base:
            curve[arm.name] = own.temperature
    return curve


def frontier(settings: EvalSettings, both: Sequence[Problem], records, resamples: int = 10_000) -> dict | None:
    """Every arm off the temperature curve against it (``esamp.eval.frontier``), on the problems
    with Vendi (and, when the task has answers, with verdicts too); None without a curve (fewer
    than two temperatures) or without Vendi."""
    curve = curve_temperatures(settings)
    diverse = [p for p in both if all(records[(p.id, a)].get("diversity") for a in settings.arms)]
    if len(curve) < 2 or not diverse:
        return None
    graded = [p for p in diverse if records[(p.id, BASELINE)]["correct"] is not None]
    problems = graded or diverse
    vendi = {a: [records[(p.id, a)]["diversity"]["vendi"] for p in problems] for a in settings.arms}
    scores = {}
    if graded:
        for k in dict.fromkeys([settings.ks[0], settings.ks[-1]]):
            scores[f"pass@{k}"] = {
                a: [pass_at_k(settings.n, records[(p.id, a)]["correct"], k) for p in problems] for a in settings.arms
            }
    return frontier_lib.analyse(curve, vendi, scores, resamples=resamples, seed=settings.seed)


def headline_metrics(summary: dict) -> list[str]:
    """The metrics of the one-line-per-cell table: pass@1, pass@(largest k), Vendi, distinct-2
    for graded tasks; the diversity measures for the others."""
    base = summary["arms"][BASELINE]
    passes = [f"pass@{k}" for k in summary["settings"]["ks"] if f"pass@{k}" in base]
    if passes:
        picked = list(dict.fromkeys([passes[0], passes[-1]])) + ["vendi", "distinct_2"]
    else:
        picked = list(DIVERSITY_KEYS)
    return [m for m in picked if m in base]


# -- terminal chart --------------------------------------------------------------------------


def ascii_chart(
    ks: Sequence[int], lines: dict[str, Sequence[float]], height: int = 20, marks: str | None = None
) -> str:
    """A text chart of pass@k (0..1, y) against k (x), one mark per arm; '*' where they meet."""
    if marks is None:
        marks = "bE" if len(lines) <= 2 else "b" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: len(lines) - 1]
    cols = [6 * i for i in range(len(ks))]
    width = cols[-1] + 1 if cols else 1
    grid = [[" "] * width for _ in range(height + 1)]
    for mark, values in zip(marks, lines.values()):
        for col, value in zip(cols, values):
            row = height - round(max(0.0, min(1.0, value)) * height)
            grid[row][col] = "*" if grid[row][col] not in (" ", mark) else mark
    out = []
    for i, cells in enumerate(grid):
        level = (height - i) / height
        label = f"{level:4.1f} |" if i % max(1, height // 5) == 0 else "     |"
        out.append(label + "".join(cells).rstrip())
    out.append("     +" + "-" * width)
    axis = [" "] * (width + 4)
    for col, k in zip(cols, ks):
        for j, ch in enumerate(str(k)):
            axis[col + j] = ch
    out.append("      " + "".join(axis).rstrip() + "   k")
    legend = "   ".join(f"{m} = {name}" for m, name in zip(marks, lines))
    out.append(f"      {legend}   * = more than one")
    return "\n".join(out)


# -- Markdown --------------------------------------------------------------------------------


VERDICT_WORDS = {
    frontier_lib.ABOVE: "above",
    frontier_lib.BELOW: "below",
    frontier_lib.ON: "on the curve",
    frontier_lib.OUTSIDE: "outside",
}


def _marked(text: str, kind: str | None) -> str:
    """``text`` in bold with its direction's mark when ``kind`` is a gain or a loss
    (``esamp.eval.direction``), else as it is."""
    return f"**{direction.MARKS[kind]} {text}**" if kind else text


def _gap_text(g: dict, metric: str, bold: bool = True) -> str:
    """A point's gap to the curve on ``metric`` with its interval and verdict; above or below the
    curve in bold, marked as a gain or a loss."""
    if math.isnan(g["gap"]):
        return "beyond the curve's Vendi range"
    text = f"{_signed(g['gap'])} [{_signed(g['low'])}, {_signed(g['high'])}]"
    if g["verdict"] == frontier_lib.OUTSIDE:
        return f"{text}, at the curve's end ({g['outside']:.0%} of resamples off it)"
    text += f" {VERDICT_WORDS[g['verdict']]}"
    decided = g["verdict"] in (frontier_lib.ABOVE, frontier_lib.BELOW)
    return _marked(text, direction.change(metric, g["low"], g["high"]) if bold and decided else None)


def _interval_text(x: dict, digits: int = 3) -> str:
    return f"{_fmt(x['mean'], digits)} [{_fmt(x['low'], digits)}, {_fmt(x['high'], digits)}]"


def frontier_sentences(summary: dict) -> list[str]:
    """Where the cells (and the plain arms off the curve) stand against the temperature curve,
    in words: one sentence per metric."""
    front = summary["frontier"]
    cells = list(summary["cells"])
    others = [a for a in summary["settings"].get("plain", {}) if a not in front["curve"]]
    lines = []
    for metric in front["gaps"]:
        gaps = front["gaps"][metric]
        by = frontier_lib.standing(front, metric, cells)
        parts = [
            f"{len(by[v])} {what}"
            for v, what in (
                (frontier_lib.BELOW, "below it"),
                (frontier_lib.ON, "on it within the interval"),
                (frontier_lib.OUTSIDE, "beyond or at the end of its Vendi range"),
            )
            if by[v]
        ]
        if by[frontier_lib.ABOVE]:
            above = "; ".join(
                f"{arm_label(a)} by {_gap_text(gaps[a], metric, bold=False)}" for a in by[frontier_lib.ABOVE]
            )
            # the only headline marked as a gain: what it says is that ESamp beats the curve
            lead = _marked(
                f"On {metric}, {len(by[frontier_lib.ABOVE])} of {len(cells)} ESamp cells lie above "
                "the temperature curve",
                direction.GAIN,
            )
            text = f"{lead}: {above}" + (f"; {', '.join(parts)}" if parts else "") + "."
        else:
            text = (
                f"**On {metric}, no ESamp cell lies above the temperature curve** "
                f"({len(cells)} cell{'s' if len(cells) != 1 else ''}: {', '.join(parts)})."
            )
        for arm in others:
            text += f" Plain {arm}: {_gap_text(gaps[arm], metric, bold=False)}."
        lines.append(text)
    equal = front["temperature_equivalent"]
    said = [f"{arm_label(a)} at T {equal[a]:.2f}" for a in cells if equal[a] is not None]
    if said:
        lines.append("As diverse (Vendi) as plain sampling: " + "; ".join(said) + ".")
    return lines


def render_frontier(summary: dict, images: Mapping[str, str], level: int) -> list[str]:
    """The section that answers "does a cell beat raising the temperature?"."""
    h = "#" * level
    front = summary["frontier"]
    temps = ", ".join(f"{t:g}" + (" (the baseline)" if a == BASELINE else "") for a, t in front["temperatures"].items())
    metrics = list(front["gaps"])
    lines = [
        "",
        f"{h} Against the temperature curve",
        "",
        f"The temperature curve is plain sampling at T {temps}, every other setting the baseline's. "
        + (
            "A point lies above it when its pass@k beats the curve's at the same Vendi; the gap is that "
            "difference with a 95% paired bootstrap interval over problems (the curve resampled too), "
            f"**bold** when the interval excludes 0: {_marked('above', direction.GAIN)} the curve (a gain) "
            f"or {_marked('below', direction.LOSS)} it (a loss)."
            if metrics
            else "This task has no answers, so there is no accuracy axis: each point's Vendi is read "
            "against the curve as the temperature that gives the same diversity."
        )
        + f" Over {front['problems']} problems.",
        "",
    ]
    lines += [f"- {line}" for line in frontier_sentences(summary)]
    header = ["arm", "T", "Vendi [95%]"]
    for m in metrics:
        header += [f"{m} [95%]", f"gap {m}"]
    header.append("as diverse as T")
    rows = []
    plain = summary["settings"].get("plain", {})
    base_t = summary["settings"]["temperature"]
    for arm, point in front["points"].items():
        t = front["temperatures"].get(arm, plain.get(arm, {}).get("temperature", base_t))
        row = [arm, f"{t:g}", _interval_text(point["vendi"], 2)]
        for m in metrics:
            gap = "(curve)" if arm in front["curve"] else _gap_text(front["gaps"][m][arm], m)
            row += [_interval_text(point[m]), gap]
        equal = front["temperature_equivalent"].get(arm)
        row.append("(curve)" if arm in front["curve"] else "—" if equal is None else f"{equal:.2f}")
        rows.append(row)
    lines += [""] + _table(header, rows, ["---"] + ["---:"] * (len(header) - 1))
    if "frontier" in images:
        lines += ["", f"![the temperature curve and every ESamp cell]({images['frontier']})"]
    return lines


def _fmt(value: float, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def _signed(value: float, digits: int = 3) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:+.{digits}f}"


def _delta_text(d: dict, metric: str) -> str:
    """A change of ``metric`` with its interval; in bold, marked as a gain or a loss, when the
    interval excludes 0."""
    text = f"{_signed(d['delta'])} [{_signed(d['low'])}, {_signed(d['high'])}]"
    return _marked(text, direction.change(metric, d["low"], d["high"]))


def _legend() -> str:
    """What bold and the marks of a table of changes mean."""
    lower = [metric_name(m) for m in direction.lower_is_better()]
    way = f"higher is better except for {', '.join(lower)}" if lower else "higher is better for every metric here"
    return (
        f"**bold**: the interval excludes 0, {_marked('a gain', direction.GAIN)} or "
        f"{_marked('a loss', direction.LOSS)} ({way})"
    )


def _table(header: Sequence[str], rows: Sequence[Sequence], align: Sequence[str] | None = None) -> list[str]:
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows
    ]


def _varying(cells: Mapping[str, dict]) -> tuple[list[str], dict]:
    """The settings that differ between cells, and those all cells share."""
    records = [c["settings"] for c in cells.values()]
    keys = list(records[0])
    varying = [k for k in keys if any(r.get(k) != records[0].get(k) for r in records)]
    return varying, {k: records[0][k] for k in keys if k not in varying}


def _settings_lines(summary: dict, both: str = "every arm") -> list[str]:
    s = summary["settings"]
    cells = summary["cells"]
    varying, shared = _varying(cells)
    shared_text = ", ".join(
        f"{'distiller_seed' if k == 'seed' else k} {format_value(v)}" for k, v in shared.items() if k != "enabled"
    )
    lines = [
        f"- n = {s['n']} samples per problem and arm; T {s['temperature']}, top-p {s['top_p']}, "
        f"min-p {s['min_p']}, top-k {s['top_k']}, max tokens {s['max_tokens']}; seed {s['seed']} "
        f"(each problem's seed is shared by {both})",
    ]
    if list(cells) == [SINGLE]:
        lines.append(f"- ESamp: {shared_text}; baseline: plain sampling with the same filters")
    else:
        lines.append(f"- {len(cells)} ESamp cells varying {', '.join(varying) or 'nothing'}; every cell: {shared_text}")
        lines.append(
            "- baseline: plain sampling with the same filters, sampled once per problem and compared with every cell"
        )
    if s.get("plain"):
        lines.append(f"- {len(s['plain'])} plain arms (ESamp off) with filters of their own: " + ", ".join(s["plain"]))
    return lines


def render_header(title: str, summaries: Sequence[dict], meta: dict) -> list[str]:
    lines = [f"# {title}", ""]
    if meta.get("commands"):
        lines += ["```", *meta["commands"], "```", ""]
    env = meta.get("environment", {})
    s = summaries[0]["settings"]
    lines.append(
        f"- engine: {env.get('engine', s['engine'])}, model: {env.get('model', s['model'])}, "
        f"device: {env.get('device', '?')}"
    )
    if s.get("prompts"):  # folders sampled before esamp recorded it have none
        lines.append(f"- prompts: {describe_record(s['prompts'])}")
    if len(summaries) == 1:
        both = "both arms" if len(summaries[0]["cells"]) == 1 else "every arm"
        lines += _settings_lines(summaries[0], both)
        p = summaries[0]["problems"]
        lines.append(f"- problems: {p['finished']} of {p['asked']} finished, {p['graded']} graded")
    else:
        lines.append("- tasks: " + ", ".join(f"{x['task']} ({x['problems']['finished']} problems)" for x in summaries))
    if env.get("versions"):
        lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()))
    if meta.get("wall_seconds") is not None:
        generation = {}
        for x in summaries:
            for arm, info in x["arms"].items():
                generation[arm] = generation.get(arm, 0.0) + info["seconds"]
        base = generation.pop(BASELINE, 0.0)
        plain_names = {a for x in summaries for a in x["settings"].get("plain", {})}
        plain = sum(generation.pop(a) for a in list(generation) if a in plain_names)
        cells = sum(generation.values())
        sessions = meta.get("sessions") or 1
        lines.append(
            f"- wall time: {meta['wall_seconds']:.0f} s in all over {sessions} session"
            f"{'s' if sessions != 1 else ''} (generation: baseline {base:.0f} s, "
            + (f"plain arms {plain:.0f} s, " if plain_names else "")
            + f"{'ESamp' if list(generation) == [SINGLE] else 'cells'} {cells:.0f} s)"
        )
    return lines


def render_task(summary: dict, images: Mapping[str, str] | None = None, level: int = 2) -> list[str]:
    """The sections of one task: cells against the baseline, totals, all metrics, pass@k,
    the quality–diversity plane, per-problem shifts."""
    h = "#" * level
    s = summary["settings"]
    arms = summary["arms"]
    cells = summary["cells"]
    names = list(cells)
    plain = list(s.get("plain", {}))
    single = names == [SINGLE]
    images = images or {}
    n = s["n"]
    lines: list[str] = []
    metrics = headline_metrics(summary)

    if not single:
        lines += [
            "",
            f"{h} Cells against the baseline",
            "",
            f"Δ is the cell minus the baseline with its 95% paired bootstrap interval over problems; {_legend()}.",
            "",
        ]
        header = ["arm"]
        for m in metrics:
            header += [metric_name(m), f"Δ {metric_name(m)}"]
        rows = [[BASELINE] + sum(([_fmt(arms[BASELINE][m]), "—"] for m in metrics), [])]
        for name in names:
            d = cells[name]["deltas"]
            rows.append([name] + sum(([_fmt(arms[name][m]), _delta_text(d[m], m)] for m in metrics), []))
        lines += _table(header, rows)

    if summary.get("frontier"):
        lines += render_frontier(summary, images, level)

    # Totals: what the arms produced, correct samples included.
    lines += ["", f"{h} {'Results' if single else 'Totals'}", ""]
    if single:
        lines += ["Δ is ESamp minus baseline; the interval is a 95% paired bootstrap over problems.", ""]
        d = cells[SINGLE]["deltas"]
        rows = [
            [
                metric_name(m),
                _fmt(x["baseline"]),
                _fmt(x["esamp"]),
                _signed(x["delta"]),
                f"[{_signed(x['low'])}, {_signed(x['high'])}]",
            ]
            for m, x in d.items()
        ]
        extra = _totals(summary, [BASELINE, SINGLE])
        rows += [[label, *values, "", ""] for label, values in extra]
        lines += _table(
            ["metric", "baseline", "ESamp", "Δ", "95% interval"], rows, ["---", "---:", "---:", "---:", "---"]
        )
    if not single or plain:
        every = [BASELINE] + plain + names
        extra = _totals(summary, every)
        if single:
            lines += ["", "Every arm:", ""]
        lines += _table(
            ["arm"] + [label for label, _ in extra],
            [[arm] + [values[i] for _, values in extra] for i, arm in enumerate(every)],
        )
    if not single:
        lines += ["", f"{h} Every metric", "", f"Each cell's Δ against the baseline [95% interval]; {_legend()}.", ""]
        metric_keys = list(cells[names[0]]["deltas"])
        rows = [
            [metric_name(m), _fmt(arms[BASELINE][m])] + [_delta_text(cells[c]["deltas"][m], m) for c in names]
            for m in metric_keys
        ]
        lines += _table(["metric", "baseline"] + names, rows)

    pass_keys = [f"pass@{k}" for k in s["ks"] if f"pass@{k}" in arms[BASELINE]]
    if pass_keys:
        lines += ["", f"{h} Pass@k against k", ""]
        if "passk" in images:
            lines.append(f"![pass@k against k, every arm]({images['passk']})")
        if single:  # a text chart stays readable with two lines only; the PNG has every cell
            chart = ascii_chart(s["ks"], {arm: [arms[arm][k] for k in pass_keys] for arm in (BASELINE, SINGLE)})
            lines += ([""] if "passk" in images else []) + ["```", chart, "```"]
    if "plane" in images:
        graded = bool(pass_keys)
        lines += [
            "",
            f"{h} {'Quality against diversity' if graded else 'Diversity by two measures'}",
            "",
            (
                f"Each cell's Δpass@{s['ks'][-1]} (up) against its ΔVendi (right), with 95% intervals; "
                "a cell up and to the right helps on both."
                if graded
                else "Each cell's Δdistinct-2 (up) against its ΔVendi (right), with 95% intervals; "
                "up and to the right is more diverse by both measures."
            ),
            "",
            f"![quality against diversity]({images['plane']})",
        ]
    if summary.get("learning"):
        lines += render_learning(summary, images, level)

    if pass_keys:
        graded_rows = [r for r in summary["per_problem"] if r[BASELINE]["correct"] is not None]
        lines += ["", f"{h} Per problem (correct of n)", ""]
        if single:
            moved = [r for r in graded_rows if r[BASELINE]["correct"] != r[SINGLE]["correct"]]
            up = sum(r[SINGLE]["correct"] > r[BASELINE]["correct"] for r in moved)
            sh = cells[SINGLE]["shifts"]
            lines += [
                f"{len(moved)} of {len(graded_rows)} problems moved: {up} up, {len(moved) - up} down; "
                f"{sh['gained']} went from 0/{n} to at least 1/{n}, {sh['lost']} the other way.",
                "",
            ]
        else:
            lines += _table(
                ["cell", "up", "down", f"0/{n} → ≥1/{n}", f"≥1/{n} → 0/{n}", "same"],
                [
                    [
                        c,
                        cells[c]["shifts"]["up"],
                        cells[c]["shifts"]["down"],
                        cells[c]["shifts"]["gained"],
                        cells[c]["shifts"]["lost"],
                        cells[c]["shifts"]["same"],
                    ]
                    for c in names
                ],
            )
            lines.append("")
        if "shifts" in images:
            lines += [f"![per-problem shifts]({images['shifts']})", ""]
        if single:
            rows = []
            for r in graded_rows:
                b, e = r[BASELINE]["correct"], r[SINGLE]["correct"]
                rows.append([r["id"], f"{b}/{n}", f"{e}/{n}", "" if b == e else f"{b}/{n} → {e}/{n}"])
            lines += _table(["problem", "baseline", "ESamp", "shift"], rows, ["---", "---:", "---:", "---"])
        else:
            rows = []
            for r in graded_rows:
                b = r[BASELINE]["correct"]
                row = [r["id"], f"{b}/{n}"]
                for c in names:
                    e = r[c]["correct"]
                    row.append(f"{e}/{n}" + ("" if e == b else f" ({e - b:+d})"))
                rows.append(row)
            lines += _table(["problem", BASELINE] + names, rows)
    div_rows = [r for r in summary["per_problem"] if r[BASELINE]["diversity"]]
    if div_rows and not pass_keys:
        lines += ["", f"{h} Per prompt: Vendi score (effective distinct samples of n)", ""]
        if "shifts" in images:
            lines += [f"![Vendi per prompt]({images['shifts']})", ""]
        if single:
            rows = []
            for r in div_rows:
                b, e = r[BASELINE]["diversity"]["vendi"], r[SINGLE]["diversity"]["vendi"]
                rows.append([r["id"], f"{b:.2f}", f"{e:.2f}", f"{e - b:+.2f}"])
            lines += _table(["prompt", "baseline", "ESamp", "Δ"], rows)
        else:
            rows = [[r["id"]] + [f"{r[a]['diversity']['vendi']:.2f}" for a in [BASELINE] + names] for r in div_rows]
            lines += _table(["prompt", BASELINE] + names, rows)
    return lines


def render_learning(summary: dict, images: Mapping[str, str], level: int) -> list[str]:
    """The section that asks whether the Distiller learns within a group: each ESamp arm's loss
    and novelty early in the replies and later, and the plot of both against position."""
    h = "#" * level
    w = learning_lib.WINDOW
    lines = [
        "",
        f"{h} Learning within a group",
        "",
        "Each ESamp arm's Distiller loss and its tokens' novelty against the token's position in the "
        "reply, the mean over the arm's groups: the loss at position p is that of the optimizer step "
        "whose inputs were the tokens at p (−1: the prompt's last token), the step that measured those "
        "tokens' novelty. A falling loss means the Distiller learns the group as it goes. Novelty is "
        "normalised per group against the group's recent errors (0.5: as surprising as its recent "
        "tokens), so a falling loss shows in it only as far as the errors fall faster than that "
        f"running mean follows. Positions are kept while at least "
        f"{learning_lib.MIN_SHARE:.0%} of an arm's groups reach them.",
        "",
    ]
    rows = []
    for arm, info in summary["learning"].items():
        loss, novelty = info["loss"], info["novelty"]
        lw, nw = info["windows"]["loss"] or {}, info["windows"]["novelty"] or {}
        prompt = loss["mean"][0] if loss and loss["position"][0] == -1 else None
        last = max((c["position"][-1] for c in (loss, novelty) if c), default=None)
        rows.append(
            [
                arm,
                info["groups"]["loss"] or info["groups"]["novelty"],
                _fmt(prompt, 4),
                _fmt(lw.get("first"), 4),
                _fmt(lw.get("rest"), 4),
                _fmt(nw.get("first"), 3),
                _fmt(nw.get("rest"), 3),
                "—" if last is None else last,
            ]
        )
    lines += _table(
        [
            "arm",
            "groups",
            "loss at the prompt",
            f"loss, positions 0–{w - 1}",
            f"loss, {w} on",
            f"novelty, 0–{w - 1}",
            f"novelty, {w} on",
            "last position kept",
        ],
        rows,
    )
    if "learning" in images:
        lines += ["", f"![Distiller loss and novelty against token position]({images['learning']})"]
    return lines


def _totals(summary: dict, arms: Sequence[str]) -> list[tuple[str, list]]:
    """Rows of totals (label, one value per arm)."""
    info = summary["arms"]
    rows: list[tuple[str, list]] = []
    base = info[BASELINE]
    if "correct" in base:
        rows.append((f"correct samples (of {base['graded_samples']})", [info[a]["correct"] for a in arms]))
        rows.append(
            (
                f"problems solved at least once (of {summary['problems']['graded']})",
                [info[a]["solved_any"] for a in arms],
            )
        )
    rows.append(("samples cut at max tokens", [info[a]["stopped_by_length"] for a in arms]))
    rows.append(("tokens generated", [info[a]["tokens"] for a in arms]))
    rows.append(("tokens/s (generation)", [info[a]["tokens_per_s"] for a in arms]))
    return rows


def render_markdown(summary: dict, meta: dict, images: Mapping[str, str] | None = None) -> str:
    """The report of one task."""
    lines = render_header(f"esamp eval: {summary['settings']['task']}", [summary], meta)
    lines += render_task(summary, images, level=2)
    if meta.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {note}" for note in meta["notes"]]
    return "\n".join(lines) + "\n"


def render_run_markdown(
    summaries: Sequence[dict], meta: dict, images: Mapping[str, Mapping[str, str]] | None = None
) -> str:
    """The report of several tasks: one header, then a section per task."""
    if len(summaries) == 1:
        return render_markdown(summaries[0], meta, (images or {}).get(summaries[0]["task"]))
    title = "esamp eval: " + ", ".join(s["task"] for s in summaries)
    lines = render_header(title, summaries, meta)
    for summary in summaries:
        p = summary["problems"]
        lines += [
            "",
            f"## {summary['task']}",
            "",
            *_settings_lines(summary),
            f"- problems: {p['finished']} of {p['asked']} finished, {p['graded']} graded",
        ]
        lines += render_task(summary, (images or {}).get(summary["task"]), level=3)
    if meta.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {note}" for note in meta["notes"]]
    return "\n".join(lines) + "\n"
