"""Pilot tests: the dashboard driven like a user would, on the scripted engine in a real worker."""

from __future__ import annotations

import csv
import json
import re
import threading
import time

import pytest
from textual.widgets import Footer, Input, Label
from textual.widgets._footer import FooterKey

from esamp.core.config import update_config
from esamp.events import ErrorEvent, event_from_dict
from esamp_tui.options import BETA_RANGE, BETA_STEP
from esamp_tui.screens.export import ExportScreen
from esamp_tui.widgets.error_panel import ErrorPanel
from esamp_tui.widgets.run_row import RunRow
from esamp_tui.widgets.sample_pane import bucket
from esamp_tui.worker import Abort, Configure, RunPrompt, run_group_key

from .conftest import run_finished, settle, wait_for
from .fake_engine import FakeEngine, token_text

SIZE = (160, 45)
pytestmark = pytest.mark.asyncio


async def type_prompt(pilot, text: str) -> None:
    prompt = pilot.app.screen.query_one("#prompt", Input)
    prompt.focus()
    prompt.value = ""
    await pilot.press(*text, "enter")


def expected_text(esamp_on: bool, count: int, mix: str = "paper") -> str:
    return "".join(token_text(esamp_on, i, mix) for i in range(count))


def header(row: RunRow) -> str:
    return str(row.query_one(".run-row--header").render())


def history(screen) -> str:
    return str(screen.query_one("#history").render())


async def test_panes_fill_with_the_scripted_stream(make_app):
    app = make_app(max_tokens=10)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: screen.controller.ready, what="engine ready")
        await type_prompt(pilot, "hello")
        await wait_for(pilot, lambda: run_finished(screen), what="run to finish")
        await settle(pilot)
        (row,) = screen.results.rows.values()
        assert row.group == "r1-on"
        assert [p.text for p in row.panes] == [expected_text(True, 8 if i == 1 else 10) for i in range(4)]
        assert [p.finish_reason for p in row.panes] == ["length", "stop", "length", "length"]
        assert row.panes[0].border_subtitle == "10 tok · nov 0.50 · length"
        assert row.distinct_2 is not None and 0 < row.distinct_2 <= 1
        assert "distinct-2" in header(row)
        assert screen.status.state == "ready" and screen.status.engine == "fake"
        assert screen.charts.rate_on.last is not None and len(screen.record.metrics) > 0


@pytest.mark.parametrize("size", [SIZE, (80, 24)], ids=["full", "one-line"])
async def test_tokens_per_s_figure_is_the_runs_rate(make_app, size):
    """Beside the chart: the run's tokens over its time, not the engine's latest windowed value
    (the scripted engine reports 50–90 tok/s whatever it does)."""
    app = make_app(n=2, max_tokens=25, engine_options=dict(delay=0.01), prompt="rate")
    async with app.run_test(size=size) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="run to finish")
        await settle(pilot)
        group = screen.record.groups["r1-on"]
        rate = group.tokens_per_s()
        assert rate == pytest.approx(group.token_count / (group.ended - group.started))
        screen.charts.redraw()
        value = str(screen.query_one("#chart-rate-value").render())
        shown = f"tok/s {rate:,.0f}" if size == (80, 24) else f"on {rate:,.1f}"
        assert shown in value and "off" not in value, value
        last_step = screen.record.metrics[-1].tokens_per_s
        # whole figures, not a substring: the last step's "90.0" is inside a run rate of "190.0"
        figures = re.findall(r"\d[\d,]*\.\d", value)
        assert f"{last_step:,.1f}" not in figures or round(last_step, 1) == round(rate, 1), value


async def test_heat_maps_to_theme_colours(make_app):
    app = make_app(max_tokens=6, prompt="heat")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="run to finish")
        await settle(pilot)
        pane = next(iter(screen.results.rows.values())).panes[0]
        for theme in ("dark", "light", "high-contrast"):
            app.theme = theme
            await pilot.pause(0.1)
            variables = app.theme_variables
            assert pane.heat_colour(bucket(0.0)) == variables["heat-0"].lower()
            assert pane.heat_colour(bucket(0.5)) == variables["heat-2"].lower()
            assert pane.heat_colour(bucket(1.0)) == variables["heat-4"].lower()
            # The drawn line uses them: sample 0's first token has novelty 0.0, its second 0.25.
            strip = pane.render_line(0)
            first = next(seg for seg in strip if seg.text.strip())
            assert first.text.startswith("on0")
            assert first.style.color.triplet.hex == variables["heat-0"].lower()


async def test_toggle_changes_state_and_next_run(make_app):
    app = make_app(max_tokens=5, prompt="toggle me")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="first run")
        assert screen.status.esamp_on is True
        await pilot.press("e")
        assert screen.esamp_on is False and screen.status.esamp_on is False  # bound, not copied
        await pilot.press("r")
        await wait_for(
            pilot, lambda: "r2-off" in screen.record.groups and run_finished(screen), what="re-run with ESamp off"
        )
        group = screen.record.groups["r2-off"]
        assert group.prompt == "toggle me" and not group.esamp_on
        tokens = [t for s in group.samples for t in s.tokens]
        assert tokens and all(t.novelty is None for t in tokens)
        assert all(t.text.startswith("off") for t in tokens)
        row = screen.results.rows["r2-off"]
        assert row.panes[0].text == expected_text(False, 5)
        assert "ESamp OFF" in header(row)
        await pilot.press("e", "r")
        await wait_for(
            pilot, lambda: "r3-on" in screen.record.groups and run_finished(screen), what="re-run with ESamp on"
        )
        assert all(t.novelty is not None for s in screen.record.groups["r3-on"].samples for t in s.tokens[:-1])


async def test_compare_mode_shows_two_rows(make_app):
    app = make_app(max_tokens=6, n=3, prompt="compare")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="first run")
        await pilot.press("c")
        await wait_for(pilot, lambda: "r2-on" in screen.record.groups and run_finished(screen), what="compare run")
        rows = list(screen.query(RunRow))
        assert [r.group for r in rows] == ["r2-off", "r2-on"]
        assert rows[0].region.y < rows[1].region.y  # two rows, one above the other
        assert [len(r.panes) for r in rows] == [3, 3]
        assert rows[0].panes[0].text == expected_text(False, 6)
        assert rows[1].panes[0].text == expected_text(True, 6)
        assert rows[0].distinct_2 is not None and rows[1].distinct_2 is not None


async def test_beta_samples_and_mix_reach_the_next_run(make_app):
    app = make_app(max_tokens=3, prompt="knobs")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="first run")
        await pilot.press("plus", "plus", "minus")
        assert screen.beta == round(0.8 + BETA_STEP, 3) and screen.status.beta == screen.beta
        await pilot.press("N", "m")
        assert screen.n == 3 and screen.mix == "unsharpened" and screen.status.mix == "unsharpened"
        assert "unsharpened" in str(screen.status.render())
        await pilot.press("r")
        await wait_for(pilot, lambda: "r2-on" in screen.record.groups and run_finished(screen), what="second run")
        group = screen.record.groups["r2-on"]
        assert group.steering.beta == screen.beta and group.steering.mix == "unsharpened"
        assert len(screen.results.rows["r2-on"].panes) == 3 and len(group.samples) == 3
        # The worker steered with the unsharpened mix: the scripted engine writes "un" for it.
        assert screen.results.rows["r2-on"].panes[0].text == expected_text(True, 3, "unsharpened")
        screen.beta = BETA_RANGE[1] - BETA_STEP / 2  # β is clamped to the range the core allows
        await pilot.press("plus", "plus")
        assert screen.beta == BETA_RANGE[1] == 10.0
        screen.beta = BETA_RANGE[0] + BETA_STEP / 2
        await pilot.press("minus", "minus")
        assert screen.beta == BETA_RANGE[0] == 0.0


async def test_abort_ends_the_running_samples_and_marks_the_history(make_app):
    app = make_app(max_tokens=500, engine_options=dict(delay=0.02))
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: screen.controller.ready, what="engine ready")
        await type_prompt(pilot, "long")
        rows = screen.results.rows
        await wait_for(pilot, lambda: rows and rows["r1-on"].panes[0].token_count > 3, what="tokens to stream")
        await pilot.press("a")
        await wait_for(pilot, lambda: run_finished(screen), what="abort")
        assert {p.finish_reason for p in rows["r1-on"].panes} == {"abort"}
        assert rows["r1-on"].panes[0].token_count < 500
        await settle(pilot)
        assert "aborted: not compared" in history(screen) and "aborted" in header(rows["r1-on"])


async def test_history_compares_like_with_like(make_app):
    app = make_app(max_tokens=6, prompt="same prompt")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="first run (ESamp on)")
        await pilot.press("e", "r")
        await wait_for(pilot, lambda: "r2-off" in screen.record.groups and run_finished(screen), what="second run")
        await settle(pilot)
        lines = history(screen).splitlines()  # newest first
        assert lines[1].startswith("run 1 · ESamp ON") and "vs run" not in lines[1]
        assert lines[0].startswith("run 2 · ESamp OFF") and "vs run 1 (ESamp ON β=0.8)" in lines[0]
        await pilot.press("N", "r")  # another n: not comparable with either
        await wait_for(pilot, lambda: "r3-off" in screen.record.groups and run_finished(screen), what="third run")
        await settle(pilot)
        assert "vs run" not in history(screen).splitlines()[0]


async def test_a_new_prompt_cuts_off_the_running_one(make_app):
    app = make_app(max_tokens=500, engine_options=dict(delay=0.02))
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: screen.controller.ready, what="engine ready")
        await type_prompt(pilot, "first")
        await wait_for(pilot, lambda: screen.results.rows["r1-on"].panes[0].token_count > 2, what="tokens")
        await type_prompt(pilot, "second")
        await settle(pilot)
        assert screen.record.groups["r1-on"].interrupted == "cut"
        assert "cut off: not compared" in history(screen)


async def test_export_writes_files_that_parse(make_app, tmp_path):
    app = make_app(max_tokens=5, prompt="export me")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="run")
        await pilot.press("x")
        await wait_for(pilot, lambda: isinstance(app.screen, ExportScreen), what="export dialog")
        target = tmp_path / "out"
        app.screen.query_one("#export-dir", Input).value = str(target)
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.record.exported, what="export to finish")
    names = sorted(p.name for p in target.iterdir())
    assert names == [
        "metrics.csv",
        "metrics.jsonl",
        "screenshot.png",
        "screenshot.svg",
        "transcript.jsonl",
        "transcript.md",
    ]
    rows = [json.loads(line) for line in (target / "transcript.jsonl").read_text().splitlines()]
    assert rows[0]["type"] == "group" and rows[0]["prompt"] == "export me"
    assert rows[0]["steering"]["beta"] == 0.8 and rows[0]["sampling"]["n"] == 4
    tokens = [event_from_dict(r) for r in rows if r["type"] == "token"]
    assert len(tokens) == 4 * 5 - 2 and tokens[0].novelty == 0.0  # sample 1 stops two early
    dones = [event_from_dict(r) for r in rows if r["type"] == "done"]
    assert len(dones) == 4
    metrics = list(csv.DictReader(open(target / "metrics.csv")))
    assert metrics and float(metrics[0]["tokens_per_s"]) >= 0 and metrics[0]["memory_kind"] == "host"
    assert [json.loads(x)["step"] for x in (target / "metrics.jsonl").read_text().splitlines()]
    md = (target / "transcript.md").read_text()
    assert "## run 1 · ESamp ON β=0.8" in md and "### sample 2 (3 tokens, finish: stop" in md
    svg = (target / "screenshot.svg").read_text()
    assert svg.lstrip().startswith("<svg") and "url(http" not in svg and 'xml:space="preserve"' in svg
    assert (target / "screenshot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_worker_crash_shows_error_panel_and_restart_works(make_app):
    app = make_app(max_tokens=20)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: screen.controller.ready, what="engine ready")
        await type_prompt(pilot, "crash")
        panel = screen.query_one(ErrorPanel)
        await wait_for(pilot, lambda: panel.visible_now, what="error panel")
        assert "stopped unexpectedly" in panel.message and "exit status 9" in panel.message and panel.fatal
        row = screen.results.rows["r1-on"]
        kept = row.panes[0].text
        assert kept.startswith("on0 on1")  # tokens already on screen stay
        assert row.panes[0].finish_reason == "error" and "failed" in header(row)
        assert screen.check_action("restart", ()) is True and screen.status.state == "error"
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: screen.controller.ready, what="restarted engine")
        assert not panel.visible_now and row.panes[0].text == kept
        await type_prompt(pilot, "after restart")
        await wait_for(
            pilot, lambda: "r2-on" in screen.record.groups and run_finished(screen), what="run after restart"
        )
        assert screen.results.rows["r2-on"].panes[0].text == expected_text(True, 20)


async def test_error_inside_a_run_ends_that_run_and_the_engine_keeps_serving(make_app):
    app = make_app(max_tokens=20, prompt="fail")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        panel = screen.query_one(ErrorPanel)
        await wait_for(pilot, lambda: panel.visible_now and run_finished(screen), what="the run to fail")
        assert "scripted failure inside step()" in panel.message and not panel.fatal
        assert "RuntimeError" in str(panel.query_one(".error--detail").render())
        assert "engine is still running" in str(panel.query_one(".error--hint").render())
        assert {p.finish_reason for p in screen.results.rows["r1-on"].panes} == {"error"}
        assert screen.status.state == "ready" and screen.controller.usable
        await type_prompt(pilot, "next")
        await wait_for(pilot, lambda: "r2-on" in screen.record.groups and run_finished(screen), what="next run")
        assert screen.results.rows["r2-on"].panes[0].text == expected_text(True, 20)
        assert not panel.visible_now  # a new run clears a run's error


async def test_a_prompt_the_engine_rejects_leaves_it_serving(make_app):
    app = make_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: screen.controller.ready, what="engine ready")
        await type_prompt(pilot, "bad start")  # the engine's start() raises, as a tokenizer can
        panel = screen.query_one(ErrorPanel)
        await wait_for(pilot, lambda: panel.visible_now and run_finished(screen), what="the run to fail")
        assert "could not start" in panel.message and "TypeError" in panel.message and not panel.fatal
        await type_prompt(pilot, "good")
        await wait_for(pilot, lambda: "r2-on" in screen.record.groups and run_finished(screen), what="next run")
        assert screen.results.rows["r2-on"].panes[0].text == expected_text(True, 4)


async def test_unreadable_prompt_is_refused_before_the_engine(make_app):
    app = make_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: screen.controller.ready, what="engine ready")
        for bad in ("Name a colour \udcff now.", "\u200b\u200b", "\x00"):
            screen.query_one("#prompt", Input).value = bad
            await pilot.press("enter")
            panel = screen.query_one(ErrorPanel)
            assert panel.visible_now and ("not valid UTF-8" in panel.message or "empty" in panel.message)
        assert screen.run_id == 0 and not screen.record.groups  # nothing was sent


async def test_model_not_found_becomes_error_panel(make_app):
    app = make_app(model="missing")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        panel = screen.query_one(ErrorPanel)
        await wait_for(pilot, lambda: panel.visible_now, what="error panel")
        assert "no model named 'missing'" in panel.message
        assert "--model PATH" in str(panel.query_one(".error--hint").render())
        await pilot.press("escape")  # the prompt has focus: leave it
        await pilot.press("r")  # nothing to run, and no crash
        assert screen.check_action("restart", ()) is True


async def test_a_models_download_shows_in_the_status_bar_until_it_is_ready(make_app):
    """A hub model's first start: the status bar says how far the download has come, then ready."""
    from esamp_tui.widgets.status import StatusBar

    app = make_app(model="Qwen/Qwen2.5-7B", engine_options=dict(download_seconds=1.5))
    async with app.run_test(size=SIZE) as pilot:
        status = app.main_screen.query_one(StatusBar)
        # the engine reports 0.5, 1.0 and 1.5 GB back to back, then waits: the bar may show each
        # (CI saw it at 25%, polled between two of them), and stays at the last while it waits
        want = "starting engine: downloading bytes 1.5 of 2.0 GB (75%)"
        await wait_for(pilot, lambda: status.state == want, what="the download's last progress (75%)")
        await wait_for(pilot, lambda: status.state == "ready", what="the engine to be ready")
        # the screen itself is never covered by Textual's loading indicator (a GPU screenshot was)
        assert not app.main_screen.loading and not app.main_screen.query("LoadingIndicator")


async def test_the_status_bar_says_which_engine_auto_picked_and_why(make_app):
    from esamp_tui.widgets.status import StatusBar

    app = make_app(engine="reference", engine_reason="auto: no CUDA GPU (vLLM 0.30.0 is installed)")
    async with app.run_test(size=(200, 45)) as pilot:
        status = app.main_screen.query_one(StatusBar)
        await wait_for(pilot, lambda: status.state == "ready", what="the engine to be ready")
        text = str(status.render())
        assert text.startswith("fake (auto: no CUDA GPU (vLLM 0.30.0 is installed)) · scripted · cpu"), text


async def test_every_binding_has_an_id_and_a_palette_entry(make_app):
    app = make_app(prompt="palette", max_tokens=3)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="run")
        assert all(b.id for b in screen.BINDINGS) and all(b.id for b in app.BINDINGS)
        titles = [c.title for c in app.get_system_commands(screen)]
        for b in screen.BINDINGS:
            if b.key == "escape" or b.id == "esamp.quit" or b.action in ("restart", "abort"):
                continue  # quit is Textual's own entry; restart/abort appear only when they apply
            assert any(t.startswith(b.description + " (") for t in titles), b.description
        assert "Quit" in titles and "Mix: paper" in titles and "Mix: unsharpened" in titles
        # Palette entries run their actions, also when the prompt box has the focus.
        screen.query_one("#prompt").focus()
        commands = {c.title: c for c in app.get_system_commands(screen)}
        await commands["ESamp (e)"].callback()
        await commands["Mix: unsharpened"].callback()
        assert screen.esamp_on is False and screen.mix == "unsharpened"


async def test_footer_offers_only_keys_that_work_where_the_focus_is(make_app):
    app = make_app(max_tokens=3)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: screen.controller.ready, what="engine ready")
        assert screen.focused is screen.query_one("#prompt")

        def footer_keys() -> set[str]:
            return {b.action for _, b, enabled, _ in screen.active_bindings.values() if b.show and enabled}

        typing = footer_keys()
        assert "beta(1)" not in typing and "toggle_esamp" not in typing and "focus('results')" in typing
        await pilot.press("e")  # types into the box
        assert screen.esamp_on is True and screen.query_one("#prompt", Input).value == "e"
        await pilot.press("escape")
        keys = footer_keys()
        assert {"beta(1)", "toggle_esamp", "rerun", "mix", "charts"} <= keys and "focus('results')" not in keys
        assert "abort" not in keys and "restart" not in keys  # nothing running, engine fine


def footer_within(screen) -> bool:
    """Every shown key ends inside the footer (the footer fits itself a frame or two after a change)."""
    footer = screen.query_one(Footer)
    keys = [key for key in footer.query(FooterKey) if key.display and key.parent.display]
    return bool(keys) and all(key.region.right <= footer.region.right for key in keys)


async def fitted(pilot, screen) -> set[str]:
    await wait_for(pilot, lambda: footer_within(screen), what="the footer to fit")
    return footer_fits(screen)


def footer_fits(screen) -> set[str]:
    """The actions the footer shows, after checking that each is whole within the terminal and
    that quit and help are among them."""
    footer = screen.query_one(Footer)
    shown = [key for key in footer.query(FooterKey) if key.display and key.parent.display]
    for key in shown:
        assert key.region.right <= footer.region.right, f"{key.action} runs past the right edge"
    actions = {key.action for key in shown}
    assert {"app.quit", "help"} <= actions or screen.typing, actions
    children = list(footer.children)
    for before, label in zip(children, children[1:]):
        if isinstance(label, Label) and label.display:  # a key group's label goes with its keys
            assert before.display and label.region.right <= footer.region.right
    return actions


@pytest.mark.parametrize(
    "width, kept", [(80, {"toggle_esamp", "rerun", "samples(1)", "beta(1)", "mix"}), (64, {"toggle_esamp", "beta(1)"})]
)
async def test_footer_never_cuts_quit_off(make_app, width, kept):
    """Idle, running and after an engine error: what works now, cut to what fits."""
    app = make_app(n=2, max_tokens=30, prompt="small")
    async with app.run_test(size=(width, 24)) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="run")
        await settle(pilot)
        assert kept <= await fitted(pilot, screen)
        screen.run_prompt("hold")
        await wait_for(pilot, lambda: any(k.action == "abort" for k in screen.query(FooterKey)), what="abort key")
        await settle(pilot)
        assert "abort" in await fitted(pilot, screen)
        await pilot.press("a")
        await wait_for(pilot, lambda: not screen.record.running(), what="abort")
        screen.run_prompt("crash")
        await wait_for(pilot, lambda: screen.controller.failed is not None, what="engine failure")
        await settle(pilot)
        assert {"restart", "hide_error"} <= await fitted(pilot, screen)
        await pilot.resize_terminal(160, 24)  # room again: what was left out comes back
        await settle(pilot)
        assert {"charts", "export", "restart", "app.quit"} <= await fitted(pilot, screen)


async def test_short_terminal_history_shows_the_newest_runs(make_app):
    app = make_app(n=2, max_tokens=4, prompt="one")
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="run 1")
        for run in (2, 3):
            await pilot.press("r")
            await wait_for(
                pilot,
                lambda run=run: f"r{run}-on" in screen.record.groups and run_finished(screen),
                what=f"run {run}",
            )
        await settle(pilot)
        widget = screen.query_one("#history")
        assert widget.region.height == 2  # a short terminal keeps two lines of history
        shown = history(screen).splitlines()[:2]
        assert shown[0].startswith("run 3 ·") and shown[1].startswith("run 2 ·")


async def test_small_terminal_gives_the_panes_the_room(make_app):
    app = make_app(n=4, max_tokens=30, prompt="small")
    async with app.run_test(size=(80, 24)) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="run")
        await settle(pilot)
        charts = screen.charts
        assert charts.mode == "compact" and charts.region.height == 1
        panes = screen.results.rows["r1-on"].panes
        assert min(p.region.height for p in panes) >= 6  # four or more lines of text each
        assert await fitted(pilot, screen)
        status = str(screen.status.render())
        assert status.rstrip().endswith("1") and "0" in status  # the novelty legend is whole
        await pilot.press("g")
        assert charts.mode == "hidden" and not charts.display
        await pilot.press("g")
        assert charts.mode == "full"
        await pilot.press("g")
        assert charts.mode == "compact"


async def test_theme_key_cycles_the_one_theme_list(make_app, tmp_path):
    themes = tmp_path / "user-themes"
    themes.mkdir()
    (themes / "mine.toml").write_text(
        'name = "mine"\n[colors]\nprimary = "#123456"\n[heat]\n'
        'stops = ["#000001", "#000002", "#000003", "#000004", "#000005"]\n'
    )
    app = make_app(theme_dir=themes, max_tokens=3, prompt="themes")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: run_finished(app.main_screen), what="run")
        assert list(app.available_themes) == ["dark", "high-contrast", "light", "mine"]
        seen = [app.theme]
        for _ in range(4):
            await pilot.press("t")
            seen.append(app.theme)
        assert seen == ["dark", "high-contrast", "light", "mine", "dark"]
        assert app.theme_variables["heat-4"] != "#000005"
        app.theme = "mine"
        await pilot.pause(0.1)
        assert app.theme_variables["heat-4"] == "#000005"


async def test_bad_user_theme_is_reported_with_its_reason(make_app, tmp_path):
    themes = tmp_path / "user-themes"
    themes.mkdir()
    (themes / "broken.toml").write_text('name = "broken"\n[colors]\nprimary = "not-a-colour"\n')
    app = make_app(theme_dir=themes, theme="broken")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: len(app._notifications) >= 2, what="both theme toasts")
        assert app.theme == "dark"
        messages = [n.message for n in app._notifications]
        assert any("broken.toml was skipped" in m and "not-a-colour" in m for m in messages)
        assert any("theme 'broken' cannot be used" in m and "not-a-colour" in m for m in messages)


async def test_slow_run_is_flagged_against_this_machines_record(make_app, tmp_path):
    record = tmp_path / "speed.json"
    # This machine "usually" does 10,000 tok/s at this shape; the scripted engine does 50-90.
    record.write_text(json.dumps({"fake · scripted · cpu": {"4 rows, ESamp on": [10_000.0]}}))
    app = make_app(max_tokens=150, speed_file=record, engine_options=dict(delay=0.02))
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: screen.controller.ready, what="engine ready")
        await type_prompt(pilot, "slow")
        await wait_for(pilot, lambda: screen.status.notice, what="the slow notice")
        assert screen.status.notice.startswith("slow: ") and "usually 10,000" in screen.status.notice
        assert "slow:" in str(screen.status.render())
        # notify() posts a message: the toast lands a moment after the status line changes.
        await wait_for(pilot, lambda: any("far slower" in n.message for n in app._notifications), what="the slow toast")
        assert all("--threads 1" not in n.message for n in app._notifications)
        await wait_for(pilot, lambda: run_finished(screen) and not screen.status.notice, what="the run to end")
        await wait_for(
            pilot,
            lambda: len(json.loads(record.read_text())["fake · scripted · cpu"]["4 rows, ESamp on"]) == 2,
            what="this run to be recorded",
        )


async def test_finished_run_shows_vendi_when_the_embedder_is_there(make_app, monkeypatch):
    texts_seen = []
    monkeypatch.setattr("esamp_tui.diversity.vendi_available", lambda: True)
    monkeypatch.setattr("esamp_tui.diversity.vendi", lambda texts: texts_seen.append(texts) or 2.5)
    app = make_app(max_tokens=4, prompt="vendi")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(
            pilot,
            lambda: screen.record.groups.get("r1-on") and screen.record.groups["r1-on"].vendi is not None,
            what="Vendi score",
        )
        await settle(pilot)
        row = screen.results.rows["r1-on"]
        assert "Vendi 2.50" in header(row)
        assert "Vendi 2.50" in history(screen)
        assert texts_seen == [[p.text for p in row.panes]]


async def test_user_keymap_rebinds_by_id_and_reports_unknown_ids(make_app, tmp_path):
    keymap = tmp_path / "my-keys.toml"
    keymap.write_text('"esamp.toggle" = "ctrl+e"\n"esamp.nope" = "z"\n')
    app = make_app(keymap_path=keymap, max_tokens=3, prompt="keys")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="run")
        await pilot.press("e")
        assert screen.esamp_on is True  # "e" no longer toggles
        await pilot.press("ctrl+e")
        assert screen.esamp_on is False
        messages = [n.message for n in app._notifications]
        assert any("'esamp.nope'" in m for m in messages)
        assert any(c.title == "ESamp (ctrl+e)" for c in app.get_system_commands(screen))


async def test_vendi_failure_is_reported_and_distinct_2_stays(make_app, monkeypatch):
    def broken(texts):
        raise RuntimeError("embedder weights missing")

    monkeypatch.setattr("esamp_tui.diversity.vendi_available", lambda: True)
    monkeypatch.setattr("esamp_tui.diversity.vendi", broken)
    app = make_app(max_tokens=4, prompt="vendi")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(
            pilot,
            lambda: any("embedder weights missing" in n.message for n in app._notifications),
            what="the Vendi notice",
        )
        await settle(pilot)
        text = header(screen.results.rows["r1-on"])
        assert "distinct-2" in text and "Vendi" not in text


async def test_export_to_an_unwritable_place_says_so_and_loses_nothing(make_app, tmp_path):
    app = make_app(max_tokens=3, prompt="export fails")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="run")
        (tmp_path / "a-file").write_text("x")
        await pilot.press("x")
        await wait_for(pilot, lambda: isinstance(app.screen, ExportScreen), what="export dialog")
        app.screen.query_one("#export-dir", Input).value = str(tmp_path / "a-file")
        await pilot.press("enter")  # a file, not a folder: the dialog stays and says why
        await pilot.pause(0.1)
        assert isinstance(app.screen, ExportScreen)
        app.screen.query_one("#export-dir", Input).value = "/proc/esamp-cannot-write-here"
        await pilot.press("enter")
        await wait_for(
            pilot,
            lambda: any(n.message.startswith("Export failed") for n in app._notifications),
            what="the export failure notice",
        )
        assert isinstance(app.screen, ExportScreen)  # still open: choose another folder
        assert screen.record.groups["r1-on"].finished and not screen.record.exported  # nothing lost
        messages = [n.message for n in app._notifications]
        assert any("is a file, not a folder" in m for m in messages)


async def test_narrow_terminal_lays_panes_out_in_a_grid(make_app):
    app = make_app(n=4, max_tokens=3, prompt="narrow")
    async with app.run_test(size=(70, 40)) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="run")
        panes = next(iter(screen.results.rows.values())).panes
        # 2 × 2, not 4 slivers (the grid is fitted when the row learns its width)
        await wait_for(pilot, lambda: len({p.region.y for p in panes}) == 2, what="a 2 × 2 grid")
        assert len({p.region.x for p in panes}) == 2


class InProcessBackend:
    """An engine behind something other than a worker process, as a client of a served endpoint
    would be: the same commands in, the same events out, nothing the screen has to know."""

    def __init__(self, spec) -> None:
        self.engine = FakeEngine(model=spec.model, esamp=spec.esamp)
        self.esamp, self.steering, self.sampling = spec.esamp, spec.esamp.steering, spec.sampling
        self.lock = threading.Lock()
        self.outbox: list = []
        self.running: list[str] = []
        self.closed = False

    def start(self):
        self.outbox.append(self.engine.ready)
        return self

    def send(self, command) -> None:
        with self.lock:
            if isinstance(command, Configure):
                self.steering, self.sampling = command.steering, command.sampling
            elif isinstance(command, (RunPrompt, Abort)):
                for key in self.running:
                    self.outbox.extend(self.engine.abort(key))
                self.running = []
            if isinstance(command, RunPrompt):
                for on in (False, True) if command.compare else (self.steering.enabled,):
                    key = run_group_key(command.run_id, on)
                    steering = update_config(self.steering, enabled=on)
                    self.running.append(self.engine.start(command.prompt, self.sampling, steering, group=key))

    def read(self, timeout: float = 0.1):
        if self.closed:
            return None
        with self.lock:
            events, self.outbox = self.outbox, []
            if self.engine.has_unfinished():
                events += self.engine.step()
        if not events:
            time.sleep(timeout)
        return events

    def lost(self):
        return ErrorEvent(message="the server closed the connection", fatal=True)

    def close(self, timeout: float = 3.0) -> None:
        self.closed = True


async def test_a_backend_without_a_worker_process_plugs_in(make_app):
    app = make_app(max_tokens=5, n=2, prompt="served")
    app.backend_factory = InProcessBackend
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="the run")
        assert isinstance(screen.controller.backend, InProcessBackend)
        assert screen.results.rows["r1-on"].panes[0].text == expected_text(True, 5)
        await pilot.press("m", "c")
        await wait_for(pilot, lambda: "r2-on" in screen.record.groups and run_finished(screen), what="compare")
        assert screen.results.rows["r2-on"].panes[0].text == expected_text(True, 5, "unsharpened")
        screen.controller.backend.close()  # the connection drops: the panel says so, ctrl+r reconnects
        await wait_for(pilot, lambda: screen.query_one(ErrorPanel).visible_now, what="the error panel")
        assert "closed the connection" in screen.query_one(ErrorPanel).message


async def test_a_batch_reaches_each_pane_in_one_append_and_hits_read_per_step(make_app, monkeypatch):
    """Tokens of several engine steps in one batch (step events between them) reach each pane in
    one append: a flush at every step event was most of the dashboard's CPU at 1,000 tok/s. The
    port-hits figure is rows per step over the last steps, so an engine whose hits arrive with a
    later step (vLLM drains its records every few steps) does not read 0."""
    from esamp_tui.controller import SessionController
    from esamp_tui.widgets.charts import HITS_STEPS
    from esamp_tui.widgets.sample_pane import SamplePane

    appends, batches = [], []
    real_append = SamplePane.append

    def counted(self, pieces):
        appends.append(self.sample)
        return real_append(self, pieces)

    monkeypatch.setattr(SamplePane, "append", counted)
    app = make_app(max_tokens=30)
    async with app.run_test(
        size=SIZE, message_hook=lambda m: batches.append(m) if isinstance(m, SessionController.EventBatch) else None
    ) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: screen.controller.ready, what="engine ready")
        await type_prompt(pilot, "hello")
        await wait_for(pilot, lambda: run_finished(screen), what="run to finish")
        await settle(pilot)
        with_tokens = {id(b) for b in batches if any(e.type == "token" for e in b.events)}
        steps = sum(e.type == "step" for b in batches for e in b.events)
        dones = sum(e.type == "done" for b in batches for e in b.events)
        # 4 panes: one append each per batch, and one more where a done must follow its tokens
        # (a batch usually holds several engine steps: here {steps} steps came in {batches})
        assert len(appends) <= 4 * (len(with_tokens) + dones), (steps, len(with_tokens))
        charts = screen.charts
        for hits in [0, 0, 0, 8] * HITS_STEPS:  # four steps' rows read back with every fourth step
            charts.add_step(charts.now + 0.01, 100.0, None, hits, True)
        charts.redraw()
        assert str(charts.query_one("#chart-hits-value").render()) == "2 rows"


def one_pane_app():
    """An app of one sample pane and nothing else."""
    from textual.app import App

    from esamp_tui.widgets.sample_pane import SamplePane

    class OnePane(App):
        def compose(self):
            yield SamplePane(0)

    return OnePane()


async def test_a_streaming_panes_subtitle_changes_at_most_once_a_second():
    """A new subtitle repaints the whole pane: while tokens stream, its count and mean novelty
    follow at most once a second (the last change arrives by timer), and a finish shows at once."""
    from esamp_tui.widgets.sample_pane import HEADER_SECONDS, SamplePane

    app = one_pane_app()
    async with app.run_test(size=(40, 10)) as pilot:
        pane = app.query_one(SamplePane)
        pane.append([("a ", 0.5)])
        assert pane.border_subtitle == "1 tok · nov 0.50"
        pane.append([("b ", 0.5)])
        assert pane.border_subtitle == "1 tok · nov 0.50" and pane.token_count == 2
        await pilot.pause(HEADER_SECONDS + 0.3)
        assert pane.border_subtitle == "2 tok · nov 0.50"
        pane.append([("c ", 0.5)])
        pane.finish("stop")
        assert pane.border_subtitle == "3 tok · nov 0.50 · stop"


async def test_a_pane_shows_its_scrollbar_only_while_the_reader_scrolls_back():
    """A pane following its newest line draws no scrollbar (redrawn on every batch, it cost a
    quarter of the UI's CPU at 1,000 tok/s); scrolled back it shows one and stays where the reader
    is while tokens arrive; back at the end it follows again. The wrap width never changes."""
    from esamp_tui.widgets.sample_pane import SamplePane

    app = one_pane_app()
    async with app.run_test(size=(40, 10)) as pilot:
        pane = app.query_one(SamplePane)
        pane.append([(f"word{i} ", 0.5) for i in range(60)])
        await pilot.pause()
        width = pane.scrollable_content_region.width
        assert pane.max_scroll_y > 0 and pane.is_vertical_scroll_end
        assert not pane.has_class("-reading") and pane.styles.scrollbar_size_vertical == 0

        pane.scroll_home(animate=False, immediate=True)
        await pilot.pause()
        assert pane.has_class("-reading") and pane.styles.scrollbar_size_vertical == 1 and pane.scroll_offset.y == 0
        assert pane.scrollable_content_region.width == width
        lines = len(pane.lines)
        pane.append([(f"more{i} ", 0.5) for i in range(30)])
        await pilot.pause()
        assert len(pane.lines) > lines and pane.scroll_offset.y == 0  # the reader's place is kept

        pane.scroll_end(animate=False, immediate=True)
        await pilot.pause()
        assert not pane.has_class("-reading") and pane.styles.scrollbar_size_vertical == 0
        assert pane.scrollable_content_region.width == width
        pane.append([("last ", 0.5)])
        await pilot.pause()
        assert pane.is_vertical_scroll_end  # following again


async def test_a_drawn_line_is_what_textuals_strip_chain_draws():
    """The pane builds each line as one strip; it must equal Textual's crop_extend + apply_offsets
    chain segment for segment (text, colour, selection offsets), wide characters and an empty line
    included."""
    from rich.segment import Segment
    from textual.strip import Strip

    app = one_pane_app()
    async with app.run_test(size=(30, 10)) as pilot:
        pane = app.query_one("SamplePane")
        pane.append([("plain ", None), ("漢字", 0.5), (" hot", 1.0), ("\n", 0.0), ("\n", None), ("tail", 0.2)])
        await pilot.pause()
        width, base = pane.scrollable_content_region.width, pane.rich_style
        styles = pane.heat_styles()
        for index, runs in enumerate(pane._wrapped.lines):
            chain = (
                Strip([Segment(text, base + styles[b]) for text, b in runs])
                .crop_extend(0, width, base)
                .apply_offsets(0, index)
            )
            drawn = pane.render_line(index)
            assert drawn.cell_length == chain.cell_length == width
            assert [(s.text, s.style) for s in drawn] == [(s.text, s.style) for s in chain], index
