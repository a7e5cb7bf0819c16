"""The report's plots (PNG, headless; terminal, plotext) and the one-file HTML, on the scripted engine."""

import importlib.util

import pytest

from esamp.core.config import EsampConfig
from esamp.eval.html import markdown_to_html
from esamp.eval.matrix import build_cells, parse_axes, validate_axes
from esamp.eval.plots import terminal_charts, write_plots
from esamp.eval.report import render_run_markdown, summarize
from esamp.eval.runner import EvalSettings, prepare_out_dir, run_groups
from esamp.eval.tasks import Problem

from .fake_engine import FakeEngine
from .test_runner import grade, measure

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (the eval extra)"
)

MATH = [Problem(id=f"m{i}", kind="math", prompt=f"question {i}", answer="2") for i in range(6)]
OPEN = [Problem(id=f"o{i}", kind="open", prompt=f"tell story {i}") for i in range(4)]
PNG = b"\x89PNG\r\n\x1a\n"


def summary_of(tmp_path, task, problems, axes=(), diversity=True):
    base = EsampConfig()
    cells = build_cells(validate_axes(parse_axes(list(axes)), base), base)
    s = EvalSettings(task=task, problem_ids=[p.id for p in problems], n=4, engine="fake", cells=cells)
    folder = tmp_path / task
    prepare_out_dir(folder, s)
    records = run_groups(problems, FakeEngine(), s, folder, grade, measure if diversity else (lambda t: None))
    return summarize(problems, records, s, resamples=500)


def test_every_view_is_written_for_a_matrix(tmp_path):
    summaries = [
        summary_of(tmp_path, "sums", MATH, ["beta=0.4,1.2", "mix=paper,unsharpened"]),
        summary_of(tmp_path, "stories", OPEN, ["beta=0.4,1.2", "mix=paper,unsharpened"]),
    ]
    images, problem = write_plots(summaries, tmp_path)
    assert problem is None
    assert images == {
        "sums": {
            "passk": "sums-passk.png",
            "plane": "sums-plane.png",
            "shifts": "sums-shifts.png",
            "learning": "sums-learning.png",
        },
        "stories": {"plane": "stories-plane.png", "shifts": "stories-shifts.png", "learning": "stories-learning.png"},
    }
    for views in images.values():
        for name in views.values():
            data = (tmp_path / name).read_bytes()
            assert data.startswith(PNG) and len(data) > 5000, name

    markdown = render_run_markdown(summaries, {"commands": ["esamp eval ..."]}, images)
    page = markdown_to_html(markdown, tmp_path)
    assert page.count("data:image/png;base64,") == 7
    assert page.startswith("<!DOCTYPE html>") and "<h2>sums</h2>" in page and "<table>" in page
    assert "**" not in page  # bold became <strong>


def test_one_cell_and_no_diversity(tmp_path):
    summary = summary_of(tmp_path, "sums", MATH, diversity=False)
    images, _ = write_plots([summary], tmp_path)
    assert set(images["sums"]) == {"passk", "shifts", "learning"}  # no Vendi, no plane


def test_terminal_charts_read_without_colour(tmp_path):
    summary = summary_of(tmp_path, "sums", MATH, ["beta=0.4,1.2"])
    text = terminal_charts([summary], colour=False, width=80)
    assert "\x1b[" not in text
    assert "pass@k against k" in text and "ΔVendi" in text
    assert "b = baseline   1 = beta=0.4   2 = beta=1.2" in text


def test_a_missing_image_is_named_not_fatal(tmp_path):
    page = markdown_to_html("# t\n\n![plot](gone.png)\n", tmp_path)
    assert "gone.png is missing" in page
