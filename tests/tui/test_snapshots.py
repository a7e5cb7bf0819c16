"""Snapshots of what a person sees (fixed terminal size, cursor blink off, scripted engine).

Update after an intended change with ``pytest tests/tui/test_snapshots.py --snapshot-update`` and
look at the report before committing.
"""

from __future__ import annotations

import pytest
from textual.widgets import Input

from .conftest import run_finished, wait_for

SIZE = (140, 40)


def prepare(until):
    async def run_before(pilot) -> None:
        app = pilot.app
        screen = app.main_screen
        screen.query_one("#prompt", Input).cursor_blink = False
        await wait_for(pilot, lambda: until(screen), timeout=20, what="the scripted run")
        await wait_for(pilot, lambda: len(screen.charts.memory.points) >= 2, what="two memory samples")
        # The sampler ticks every second, so a slow machine takes more readings before the picture:
        # no more readings, and exactly two in the memory sparkline.
        screen.charts.memory_sampler = None
        while len(screen.charts.memory.points) > 2:
            screen.charts.memory.points.popleft()
        await pilot.pause(0.2)
        # A run's tokens/s is its tokens over wall time, which varies from run to run: fixed here
        # (tests/tui/test_app.py checks the figure itself).
        screen.charts.run_rates = {on: 42.0 if on else 36.0 for on in screen.record.run_rates()}
        screen.charts.redraw()
        app.clear_notifications()
        await pilot.pause(0.1)

    return run_before


def test_main_screen_after_streaming(snap_compare, make_app):
    app = make_app(n=4, max_tokens=30, prompt="Name three colours")
    assert snap_compare(app, terminal_size=SIZE, run_before=prepare(run_finished))


def test_main_screen_mid_stream(snap_compare, make_app):
    app = make_app(n=4, max_tokens=30, prompt="hold")

    def held(screen) -> bool:
        row = screen.query_one("#results").rows.get("r1-on")
        return row is not None and all(p.token_count == 6 for p in row.panes)

    assert snap_compare(app, terminal_size=SIZE, run_before=prepare(held))


def test_compare_view(snap_compare, make_app):
    app = make_app(n=3, max_tokens=12, prompt="compare")

    async def run_before(pilot):
        screen = pilot.app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="first run")
        await pilot.press("c")
        await prepare(lambda s: "r2-on" in s.record.groups and run_finished(s))(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


@pytest.mark.parametrize("theme", ["dark", "light", "high-contrast"])
def test_builtin_theme(snap_compare, make_app, theme):
    app = make_app(n=2, max_tokens=20, prompt="themes", theme=theme)
    assert snap_compare(app, terminal_size=(100, 40), run_before=prepare(run_finished))


def test_error_panel_after_a_crash(snap_compare, make_app):
    app = make_app(n=2, max_tokens=20, prompt="crash")
    assert snap_compare(app, terminal_size=SIZE, run_before=prepare(lambda s: s.query_one("#error").visible_now))


def test_small_terminal(snap_compare, make_app):
    """80×24: the panes get the rows; charts as one line of values; footer and legend whole."""
    app = make_app(n=4, max_tokens=30, prompt="Name three colours")
    assert snap_compare(app, terminal_size=(80, 24), run_before=prepare(run_finished))


def test_history_marks_and_comparisons(snap_compare, make_app):
    """Run 1 on, run 2 off (compared with run 1), run 3 aborted (marked, not compared)."""
    app = make_app(n=2, max_tokens=12, prompt="compare me")

    async def run_before(pilot):
        screen = pilot.app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="run 1")
        await pilot.press("e", "r")
        await wait_for(pilot, lambda: "r2-off" in screen.record.groups and run_finished(screen), what="run 2")
        screen.run_prompt("hold")
        await wait_for(pilot, lambda: screen.results.rows["r3-off"].panes[0].token_count == 6, what="run 3")
        await pilot.press("a")
        await prepare(lambda s: run_finished(s))(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
