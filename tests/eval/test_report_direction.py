"""A change whose interval excludes 0 is bold in both reports and marked by its direction: a gain
(▲, green in the HTML) or a loss (▼, red), as ``esamp.eval.direction`` says per metric; a change
whose interval holds 0 is plain; the frontier headline is a gain only when a cell lies above the
temperature curve. Re-drawing a folder's report (``--report-only`` without a task) picks up the
marks without sampling or summarising again."""

from __future__ import annotations

import json
import re

import pytest

from esamp.eval import direction
from esamp.eval.html import markdown_to_html
from esamp.eval.report import DIVERSITY_KEYS, render_markdown

from .test_frontier import MATH, run

GAIN = {"delta": 0.1, "low": 0.02, "high": 0.2}
LOSS = {"delta": -0.081, "low": -0.156, "high": -0.012}
NOISE = {"delta": 0.19, "low": -0.088, "high": 0.488}


def _gap(gap, low, high, verdict):
    return {"gap": gap, "low": low, "high": high, "outside": 0.0, "verdict": verdict}


@pytest.fixture
def summary(tmp_path):
    """The scripted run with plain arms, its numbers set: beta=0.4 gains pass@1, beta=1.2 loses it,
    beta=0.4's Vendi moves within noise; on pass@1 beta=0.4 lies above the curve and beta=1.2
    below it, on pass@8 both lie on it."""
    s = run(tmp_path, MATH)
    cells = s["cells"]
    cells["beta=0.4"]["deltas"]["pass@1"].update(GAIN)
    cells["beta=1.2"]["deltas"]["pass@1"].update(LOSS)
    cells["beta=0.4"]["deltas"]["vendi"].update(NOISE)
    gaps = s["frontier"]["gaps"]
    gaps["pass@1"]["beta=0.4"] = _gap(0.05, 0.01, 0.09, "above")
    gaps["pass@1"]["beta=1.2"] = _gap(-0.099, -0.216, -0.011, "below")
    for cell in ("beta=0.4", "beta=1.2"):
        gaps["pass@8"][cell] = _gap(0.01, -0.05, 0.07, "on")
    return s


def _rows(md: str, first_cell: str) -> list[str]:
    return [line for line in md.splitlines() if line.startswith(f"| {first_cell} |")]


def test_markdown_marks_a_gain_and_a_loss_and_leaves_noise_plain(summary):
    md = render_markdown(summary, {})
    cells_table = md[md.index("## Cells against the baseline") : md.index("## Against the temperature curve")]
    assert "| beta=0.4 |" in cells_table and "**▲ +0.100 [+0.020, +0.200]**" in cells_table
    assert "**▼ -0.081 [-0.156, -0.012]**" in cells_table
    assert "| +0.190 [-0.088, +0.488] |" in cells_table  # holds 0: neither bold nor marked
    legend = "**bold**: the interval excludes 0, **▲ a gain** or **▼ a loss** (higher is better for every metric here)"
    assert legend in md
    every = md[md.index("## Every metric") :]
    (pass1,) = [line for line in every.splitlines() if line.startswith("| pass@1 |")]
    assert pass1.endswith("| **▲ +0.100 [+0.020, +0.200]** | **▼ -0.081 [-0.156, -0.012]** |")


def test_markdown_headline_is_a_gain_only_when_a_cell_lies_above_the_curve(summary):
    md = render_markdown(summary, {})
    assert "- **▲ On pass@1, 1 of 2 ESamp cells lie above the temperature curve**: beta=0.4 by +0.050" in md
    assert "- **On pass@8, no ESamp cell lies above the temperature curve** (2 cells: 2 on it" in md
    front = md[md.index("## Against the temperature curve") : md.index("## Totals")]
    assert "**▲ +0.050 [+0.010, +0.090] above**" in front and "**▼ -0.099 [-0.216, -0.011] below**" in front
    assert "| +0.010 [-0.050, +0.070] on the curve |" in front


def test_html_colours_by_direction(summary, tmp_path):
    page = markdown_to_html(render_markdown(summary, {}), tmp_path)
    assert '<strong class="gain">▲ +0.100 [+0.020, +0.200]</strong>' in page
    assert '<strong class="loss">▼ -0.081 [-0.156, -0.012]</strong>' in page
    assert '<td class="num">+0.190 [-0.088, +0.488]</td>' in page
    assert '<strong class="gain">▲ On pass@1, 1 of 2 ESamp cells lie above the temperature curve</strong>' in page
    assert "<strong>On pass@8, no ESamp cell lies above the temperature curve</strong>" in page
    assert '<strong class="loss">▼ -0.099 [-0.216, -0.011] below</strong>' in page
    style = page[page.index("<style>") : page.index("</style>")]
    assert re.search(r"strong\.gain \{ color: #0[0-9a-f]{5}", style)  # green: little red
    assert re.search(r"strong\.loss \{ color: #[c-f][0-9a-f]{5}", style)  # red
    assert not re.search(r"(^|[\s}])strong \{", style)  # a bold span without a mark keeps the text's colour


def test_a_metric_where_lower_is_better_turns_a_fall_into_a_gain(summary, tmp_path, monkeypatch):
    monkeypatch.setitem(direction.BETTER, "pass@k", direction.LOWER)
    md = render_markdown(summary, {})
    assert "**▼ +0.100 [+0.020, +0.200]**" in md and "**▲ -0.081 [-0.156, -0.012]**" in md
    assert "(higher is better except for pass@k)" in md
    # the gap reads as its pass@k does: below the curve is then the better side
    assert "**▲ -0.099 [-0.216, -0.011] below**" in md
    page = markdown_to_html(md, tmp_path)
    assert '<strong class="loss">▼ +0.100 [+0.020, +0.200]</strong>' in page


def test_every_reported_metric_has_a_direction():
    for metric in (*DIVERSITY_KEYS, "pass@1", "pass@32"):
        assert direction.better(metric) == direction.HIGHER
    with pytest.raises(KeyError, match="add it to BETTER"):
        direction.better("perplexity")
    assert direction.change("vendi", -0.1, 0.1) is None and direction.change("vendi", float("nan"), 1.0) is None
    assert direction.change("vendi", 0.0, 0.2) is None  # touching 0 is not excluding it


def test_report_only_without_a_task_draws_the_report_again(summary, tmp_path, capsys):
    from esamp.commands.cli import main

    out = tmp_path / "run"
    out.mkdir()
    (out / "report.json").write_text(json.dumps({**summary, "meta": {"commands": ["esamp eval --task t"]}}))
    (out / "t-passk.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    assert main(["eval", "--report-only", "--out", str(out), "--quiet"]) == 0
    md = (out / "report.md").read_text()
    assert "**▼ -0.081 [-0.156, -0.012]**" in md and "esamp eval --task t" in md  # no sessions.json: the meta kept
    assert "](t-passk.png)" in md and "t-plane.png" not in md  # the plots that are there
    assert '<strong class="loss">' in (out / "report.html").read_text()
    assert not (out / "samples.jsonl").exists()  # nothing sampled
    assert "again from report.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--report-only"], "name the folder"),
        (["--report-only", "--out", "nowhere"], "report.json does not exist"),
        (["--report-only", "--out", "{out}", "--matrix", "beta=0.4"], "--matrix needs a task"),
    ],
)
def test_report_only_without_a_task_refuses_what_it_cannot_do(args, needle, tmp_path, capsys):
    from esamp.commands.cli import main

    assert main(["eval", *[a.format(out=tmp_path) for a in args]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and "hint: " in err


def test_report_only_refuses_a_report_of_an_older_esamp(tmp_path, capsys):
    from esamp.commands.cli import main

    (tmp_path / "report.json").write_text(json.dumps({"settings": {}, "arms": {}, "deltas": {}, "meta": {}}))
    assert main(["eval", "--report-only", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "older esamp" in err and "--task" in err
