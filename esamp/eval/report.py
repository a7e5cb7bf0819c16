"""Turn the records of a finished run into numbers, a JSON file and a Markdown report.

Everything here is a pure function of the records and settings (the bootstrap is seeded), so a
resumed run reports exactly what an uninterrupted one would.
"""

from __future__ import annotations

import math
from typing import Sequence

from esamp.eval.passk import pass_at_k
from esamp.eval.runner import ARMS, EvalSettings
from esamp.eval.stats import paired_bootstrap
from esamp.eval.tasks import Problem

DIVERSITY_KEYS = ("vendi", "cosine_distance", "distinct_1", "distinct_2")


def summarize(problems: Sequence[Problem], records: dict[tuple[str, str], dict],
              settings: EvalSettings, resamples: int = 10_000) -> dict:
    """Per-arm metrics, ESamp-minus-baseline deltas with paired bootstrap intervals, and the
    per-problem table. Only problems that both arms finished count."""
    both = [p for p in problems if all((p.id, arm) in records for arm in ARMS)]
    graded = [p for p in both if records[(p.id, "baseline")]["correct"] is not None]
    diverse = [p for p in both if records[(p.id, "baseline")].get("diversity")]
    n = settings.n

    per_arm: dict[str, dict] = {}
    series: dict[str, dict[str, list[float]]] = {}  # metric -> arm -> per-problem values
    for arm in ARMS:
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

    deltas = {
        metric: paired_bootstrap(arms["baseline"], arms["esamp"], resamples=resamples,
                                 seed=settings.seed).to_dict()
        for metric, arms in series.items()
    }

    rows = []
    for p in both:
        row = {"id": p.id, "kind": p.kind}
        for arm in ARMS:
            r = records[(p.id, arm)]
            row[arm] = {"correct": r["correct"], "tokens": sum(r["tokens"]),
                        "diversity": r.get("diversity")}
        rows.append(row)
    return {
        "settings": settings.to_dict(),
        "problems": {"asked": len(problems), "finished": len(both), "graded": len(graded),
                     "with_diversity": len(diverse)},
        "arms": per_arm,
        "deltas": deltas,
        "per_problem": rows,
    }


# -- terminal chart --------------------------------------------------------------------------


def ascii_chart(ks: Sequence[int], lines: dict[str, Sequence[float]], height: int = 20,
                marks: str = "bE") -> str:
    """A text chart of pass@k (0..1, y) against k (x), one mark per arm; '*' where they meet."""
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
    out.append(f"      {legend}   * = both")
    return "\n".join(out)


# -- Markdown --------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def _signed(value: float, digits: int = 3) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:+.{digits}f}"


def render_markdown(summary: dict, meta: dict) -> str:
    s = summary["settings"]
    arms = summary["arms"]
    lines = [f"# esamp eval: {s['task']}", ""]
    if meta.get("command"):
        lines += ["```", meta["command"], "```", ""]
    env = meta.get("environment", {})
    lines += [
        f"- engine: {env.get('engine', s['engine'])}, model: {env.get('model', s['model'])}, "
        f"device: {env.get('device', '?')}",
        f"- n = {s['n']} samples per problem and arm; T {s['temperature']}, top-p {s['top_p']}, "
        f"min-p {s['min_p']}, top-k {s['top_k']}, max tokens {s['max_tokens']}; seed {s['seed']} "
        "(each problem's seed is shared by both arms)",
        f"- ESamp: beta {s['beta']}, mix '{s['mix']}'; baseline: plain sampling with the same filters",
        f"- problems: {summary['problems']['finished']} of {summary['problems']['asked']} finished, "
        f"{summary['problems']['graded']} graded",
    ]
    if env.get("versions"):
        lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()))
    if meta.get("wall_seconds") is not None:
        lines.append(f"- wall time: {meta['wall_seconds']:.0f} s in all (generation: baseline "
                     f"{arms['baseline']['seconds']:.0f} s, ESamp {arms['esamp']['seconds']:.0f} s)")
    lines += ["", "## Results", "",
              "Δ is ESamp minus baseline; the interval is a 95% paired bootstrap over problems.", "",
              "| metric | baseline | ESamp | Δ | 95% interval |", "|---|---:|---:|---:|---|"]
    for metric, d in summary["deltas"].items():
        lines.append(f"| {metric} | {_fmt(d['baseline'])} | {_fmt(d['esamp'])} | "
                     f"{_signed(d['delta'])} | [{_signed(d['low'])}, {_signed(d['high'])}] |")
    for key, label in (("tokens_per_s", "tokens/s (generation)"), ("tokens", "tokens generated"),
                       ("stopped_by_length", "samples cut at max tokens")):
        lines.append(f"| {label} | {arms['baseline'][key]} | {arms['esamp'][key]} | | |")

    pass_keys = [f"pass@{k}" for k in s["ks"] if f"pass@{k}" in arms["baseline"]]
    if pass_keys:
        chart = ascii_chart(s["ks"], {arm: [arms[arm][k] for k in pass_keys] for arm in ARMS})
        lines += ["", "## Pass@k against k", "", "```", chart, "```"]
        graded_rows = [r for r in summary["per_problem"] if r["baseline"]["correct"] is not None]
        moved = [r for r in graded_rows if r["baseline"]["correct"] != r["esamp"]["correct"]]
        up = sum(r["esamp"]["correct"] > r["baseline"]["correct"] for r in moved)
        lines += ["", "## Per problem (correct of n)", "",
                  f"{len(moved)} of {len(graded_rows)} problems moved: {up} up, {len(moved) - up} down.", "",
                  "| problem | baseline | ESamp | shift |", "|---|---:|---:|---|"]
        n = s["n"]
        for r in graded_rows:
            b, e = r["baseline"]["correct"], r["esamp"]["correct"]
            shift = "" if b == e else f"{b}/{n} → {e}/{n}"
            lines.append(f"| {r['id']} | {b}/{n} | {e}/{n} | {shift} |")
    div_rows = [r for r in summary["per_problem"] if r["baseline"]["diversity"]]
    if div_rows and not pass_keys:
        lines += ["", "## Per prompt: Vendi score (effective distinct samples of n)", "",
                  "| prompt | baseline | ESamp | Δ |", "|---|---:|---:|---:|"]
        for r in div_rows:
            b, e = r["baseline"]["diversity"]["vendi"], r["esamp"]["diversity"]["vendi"]
            lines.append(f"| {r['id']} | {b:.2f} | {e:.2f} | {e - b:+.2f} |")
    if meta.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {note}" for note in meta["notes"]]
    return "\n".join(lines) + "\n"
