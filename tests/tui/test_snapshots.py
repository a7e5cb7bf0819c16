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
        # Two readings: one point draws a full bar, two or more equal ones a flat line.
        await wait_for(pilot, lambda: len(screen.charts.memory) >= 2, what="two memory samples")
        await pilot.pause(0.2)
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
        row = screen.rows.get("r1-on")
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
    assert snap_compare(app, terminal_size=(100, 30), run_before=prepare(run_finished))


def test_error_panel_after_a_crash(snap_compare, make_app):
    app = make_app(n=2, max_tokens=20, prompt="crash")
    assert snap_compare(app, terminal_size=SIZE,
                        run_before=prepare(lambda s: s.query_one("#error").visible_now))
