"""The dashboard tells what the committed runs measured for its model: the ESamp row of a compare
run and the help screen (esamp.eval.standing; the figures come from the run's report.json)."""

from __future__ import annotations

import pytest

# tests/ is on the path, as for tui.conftest in fake_app.py
from eval.test_standing import add_shared_cell, write_report
from textual.widgets import Markdown

from esamp.eval.standing import FRONTIER_RUNS
from esamp_tui.screens.help import HelpScreen
from esamp_tui.widgets.run_row import RunRow

from .conftest import run_finished, wait_for

pytestmark = pytest.mark.asyncio
SIZE = (180, 40)


async def test_compare_row_and_help_say_what_esamp_does_on_this_model(make_app, monkeypatch, tmp_path):
    monkeypatch.setitem(FRONTIER_RUNS, "scripted", "m/arith")  # the scripted engine's model
    monkeypatch.setattr("esamp.eval.standing.RESULTS", tmp_path)
    write_report(tmp_path)
    app = make_app(max_tokens=4, n=2, prompt="compare")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="first run")
        assert all(r.note is None for r in screen.query(RunRow))  # one row: nothing to explain
        await pilot.press("c")
        await wait_for(pilot, lambda: "r2-on" in screen.record.groups and run_finished(screen), what="compare")
        off, on = screen.results.rows["r2-off"], screen.results.rows["r2-on"]
        assert off.note is None
        assert "measured on arith: Vendi −0.27 [−0.45, −0.10] (narrower)" in on._header_text()
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        text = app.screen.query_one(Markdown).source
        assert "**ESamp on this model.** Measured on scripted" in text and "−0.05 [−0.09, −0.01]" in text


async def test_a_dashboard_with_the_shared_distiller_reads_that_cell(make_app, monkeypatch, tmp_path):
    """The compare row and the help read the committed cell of the dashboard's own Distiller mode."""
    monkeypatch.setitem(FRONTIER_RUNS, "scripted", "m/arith")
    monkeypatch.setattr("esamp.eval.standing.RESULTS", tmp_path)
    write_report(tmp_path)
    add_shared_cell(tmp_path, vendi=-0.5)
    app = make_app(max_tokens=4, n=2, prompt="compare", distiller="shared")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="first run")
        await pilot.press("c")
        await wait_for(pilot, lambda: "r2-on" in screen.record.groups and run_finished(screen), what="compare")
        assert "Vendi −0.50" in screen.results.rows["r2-on"]._header_text()
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        assert "Vendi −0.50" in app.screen.query_one(Markdown).source


async def test_no_note_for_a_model_without_a_run(make_app):
    app = make_app(max_tokens=4, n=2, prompt="compare")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="first run")
        await pilot.press("c")
        await wait_for(pilot, lambda: "r2-on" in screen.record.groups and run_finished(screen), what="compare")
        assert screen.results.rows["r2-on"].note is None
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        assert "ESamp on this model" not in app.screen.query_one(Markdown).source
