"""Pilot tests: the dashboard driven like a user would, on the scripted engine in a real worker."""

from __future__ import annotations

import csv
import json

import pytest
from textual.widgets import Input

from esamp.events import event_from_dict
from esamp_tui.options import BETA_STEP
from esamp_tui.screens.export import ExportScreen
from esamp_tui.widgets.error_panel import ErrorPanel
from esamp_tui.widgets.run_row import RunRow
from esamp_tui.widgets.sample_pane import bucket

from .conftest import run_finished, settle, wait_for
from .fake_engine import token_text

SIZE = (160, 45)
pytestmark = pytest.mark.asyncio


async def type_prompt(pilot, text: str) -> None:
    prompt = pilot.app.screen.query_one("#prompt", Input)
    prompt.focus()
    prompt.value = ""
    await pilot.press(*text, "enter")


def expected_text(esamp_on: bool, count: int) -> str:
    return "".join(token_text(esamp_on, i) for i in range(count))


async def test_panes_fill_with_the_scripted_stream(make_app):
    app = make_app(max_tokens=10)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: screen.engine_ready, what="engine ready")
        await type_prompt(pilot, "hello")
        await wait_for(pilot, lambda: run_finished(screen), what="run to finish")
        await settle(pilot)
        (row,) = screen.rows.values()
        assert row.group == "r1-on"
        assert [p.text for p in row.panes] == [expected_text(True, 8 if i == 1 else 10) for i in range(4)]
        assert [p.finish_reason for p in row.panes] == ["length", "stop", "length", "length"]
        assert row.panes[0].border_subtitle == "10 tok · nov 0.50 · length"
        assert row.distinct_2 is not None and 0 < row.distinct_2 <= 1
        assert "distinct-2" in str(row.query_one(".run-row--header").render())
        assert screen.status.info.state == "ready" and screen.status.info.engine == "fake"
        assert screen.charts.last_rate is not None and len(screen.record.metrics) > 0


async def test_heat_maps_to_theme_colours(make_app):
    app = make_app(max_tokens=6, prompt="heat")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="run to finish")
        await settle(pilot)
        pane = next(iter(screen.rows.values())).panes[0]
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
        assert screen.status.info.esamp_on is True
        await pilot.press("e")
        assert screen.esamp_on is False and screen.status.info.esamp_on is False
        await pilot.press("r")
        await wait_for(pilot, lambda: "r2-off" in screen.record.groups and run_finished(screen),
                       what="re-run with ESamp off")
        group = screen.record.groups["r2-off"]
        assert group.prompt == "toggle me" and not group.esamp_on
        tokens = [t for s in group.samples for t in s.tokens]
        assert tokens and all(t.novelty is None for t in tokens)
        assert all(t.text.startswith("off") for t in tokens)
        row = screen.rows["r2-off"]
        assert row.panes[0].text == expected_text(False, 5)
        assert "ESamp OFF" in str(row.query_one(".run-row--header").render())
        await pilot.press("e", "r")
        await wait_for(pilot, lambda: "r3-on" in screen.record.groups and run_finished(screen),
                       what="re-run with ESamp on")
        assert all(t.novelty is not None for s in screen.record.groups["r3-on"].samples
                   for t in s.tokens[:-1])


async def test_compare_mode_shows_two_rows(make_app):
    app = make_app(max_tokens=6, n=3, prompt="compare")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="first run")
        await pilot.press("c")
        await wait_for(pilot, lambda: "r2-on" in screen.record.groups and run_finished(screen),
                       what="compare run")
        rows = list(screen.query(RunRow))
        assert [r.group for r in rows] == ["r2-off", "r2-on"]
        assert rows[0].region.y < rows[1].region.y  # two rows, one above the other
        assert [len(r.panes) for r in rows] == [3, 3]
        assert rows[0].panes[0].text == expected_text(False, 6)
        assert rows[1].panes[0].text == expected_text(True, 6)
        assert rows[0].distinct_2 is not None and rows[1].distinct_2 is not None


async def test_beta_and_samples_keys_apply_to_next_run(make_app):
    app = make_app(max_tokens=3, prompt="knobs")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="first run")
        await pilot.press("plus", "plus", "minus")
        assert screen.beta == round(0.8 + BETA_STEP, 3) and screen.status.info.beta == screen.beta
        await pilot.press("N")
        assert screen.n == 3
        await pilot.press("r")
        await wait_for(pilot, lambda: "r2-on" in screen.record.groups and run_finished(screen),
                       what="second run")
        row = screen.rows["r2-on"]
        assert len(row.panes) == 3 and row.beta == screen.beta
        assert len(screen.record.groups["r2-on"].samples) == 3  # the worker used n=3 too


async def test_abort_ends_the_running_samples(make_app):
    app = make_app(max_tokens=500, engine_options=dict(delay=0.02))
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: screen.engine_ready, what="engine ready")
        await type_prompt(pilot, "long")
        await wait_for(pilot, lambda: screen.rows and screen.rows["r1-on"].panes[0].token_count > 3,
                       what="tokens to stream")
        await pilot.press("a")
        await wait_for(pilot, lambda: run_finished(screen), what="abort")
        assert {p.finish_reason for p in screen.rows["r1-on"].panes} == {"abort"}
        assert screen.rows["r1-on"].panes[0].token_count < 500


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
        await wait_for(pilot, lambda: screen.exports, what="export to finish")
    names = sorted(p.name for p in target.iterdir())
    assert names == ["metrics.csv", "metrics.jsonl", "screenshot.svg", "transcript.jsonl", "transcript.md"]
    rows = [json.loads(line) for line in (target / "transcript.jsonl").read_text().splitlines()]
    assert rows[0]["type"] == "group" and rows[0]["prompt"] == "export me"
    tokens = [event_from_dict(r) for r in rows if r["type"] == "token"]
    assert len(tokens) == 4 * 5 - 2 and tokens[0].novelty == 0.0  # sample 1 stops two early
    dones = [event_from_dict(r) for r in rows if r["type"] == "done"]
    assert len(dones) == 4
    metrics = list(csv.DictReader(open(target / "metrics.csv")))
    assert metrics and float(metrics[0]["tokens_per_s"]) >= 0 and metrics[0]["memory_kind"] == "host"
    assert [json.loads(x)["step"] for x in (target / "metrics.jsonl").read_text().splitlines()]
    md = (target / "transcript.md").read_text()
    assert "## run 1 · ESamp ON β=0.8" in md and "### sample 2 (3 tokens, finish: stop" in md
    assert (target / "screenshot.svg").read_text().lstrip().startswith("<svg")


async def test_worker_crash_shows_error_panel_and_restart_works(make_app):
    app = make_app(max_tokens=20)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: screen.engine_ready, what="engine ready")
        await type_prompt(pilot, "crash")
        panel = screen.query_one(ErrorPanel)
        await wait_for(pilot, lambda: panel.visible_now, what="error panel")
        assert "stopped unexpectedly" in panel.message and "exit status 9" in panel.message
        row = screen.rows["r1-on"]
        kept = row.panes[0].text
        assert kept.startswith("on0 on1")  # tokens already on screen stay
        assert row.panes[0].finish_reason == "error"
        assert screen.check_action("restart", ()) is True
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: screen.engine_ready, what="restarted engine")
        assert not panel.visible_now and row.panes[0].text == kept
        await type_prompt(pilot, "after restart")
        await wait_for(pilot, lambda: "r2-on" in screen.record.groups and run_finished(screen),
                       what="run after restart")
        assert screen.rows["r2-on"].panes[0].text == expected_text(True, 20)


async def test_engine_error_inside_step_shows_traceback(make_app):
    app = make_app(max_tokens=20, prompt="fail")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        panel = screen.query_one(ErrorPanel)
        await wait_for(pilot, lambda: panel.visible_now, what="error panel")
        assert "scripted failure inside step()" in panel.message
        detail = str(panel.query_one(".error--detail").render())
        assert "RuntimeError" in detail
        assert screen.status.info.state == "error"


async def test_model_not_found_becomes_error_panel(make_app):
    app = make_app(model="missing")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        panel = screen.query_one(ErrorPanel)
        await wait_for(pilot, lambda: panel.visible_now, what="error panel")
        assert "no model named 'missing'" in panel.message
        hint = str(panel.query_one(".error--hint").render())
        assert "--model PATH" in hint
        await pilot.press("escape")  # the prompt has focus: leave it
        await pilot.press("r")  # nothing to run, and no crash
        assert screen.check_action("restart", ()) is True


async def test_every_binding_has_an_id_and_a_palette_entry(make_app):
    app = make_app(prompt="palette", max_tokens=3)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="run")
        assert all(b.id for b in screen.BINDINGS) and all(b.id for b in app.BINDINGS)
        titles = [c.title for c in app.get_system_commands(screen)]
        for b in screen.BINDINGS:
            if not b.show or b.action.startswith("app.") or b.action in ("restart", "abort"):
                continue  # quit is Textual's own entry; restart/abort appear only when they apply
            assert any(t.startswith(b.description + " (") for t in titles), b.description
        assert "Quit" in titles
        # A palette entry runs its action.
        toggle = next(c for c in app.get_system_commands(screen) if c.title.startswith("ESamp on/off"))
        await toggle.callback()
        assert screen.esamp_on is False


async def test_narrow_terminal_lays_panes_out_in_a_grid(make_app):
    app = make_app(n=4, max_tokens=3, prompt="narrow")
    async with app.run_test(size=(70, 40)) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="run")
        await settle(pilot)
        panes = next(iter(screen.rows.values())).panes
        ys = sorted({p.region.y for p in panes})
        assert len(ys) == 2  # 2 × 2, not 4 slivers


async def test_bad_user_theme_is_reported_and_default_used(make_app, tmp_path):
    themes = tmp_path / "user-themes"
    themes.mkdir()
    (themes / "broken.toml").write_text('name = "broken"\n[colors]\nprimary = "not-a-colour"\n')
    (themes / "mine.toml").write_text(
        'name = "mine"\n[colors]\nprimary = "#123456"\n[heat]\n'
        'stops = ["#000001", "#000002", "#000003", "#000004", "#000005"]\n')
    app = make_app(theme_dir=themes, theme="broken")
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause(0.2)
        assert app.theme == "dark"
        messages = [n.message for n in app._notifications]
        assert any("broken.toml was skipped" in m and "not-a-colour" in m for m in messages)
        assert any("'broken' is not installed" in m for m in messages)
        assert "mine" in app.esamp_theme_names
        app.theme = "mine"
        await pilot.pause(0.1)
        assert app.theme_variables["heat-4"] == "#000005"


async def test_finished_run_shows_vendi_when_the_embedder_is_there(make_app, monkeypatch):
    texts_seen = []
    monkeypatch.setattr("esamp_tui.diversity.vendi_available", lambda: True)
    monkeypatch.setattr("esamp_tui.diversity.vendi", lambda texts: texts_seen.append(texts) or 2.5)
    app = make_app(max_tokens=4, prompt="vendi")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: screen.record.groups.get("r1-on") and
                       screen.record.groups["r1-on"].vendi is not None, what="Vendi score")
        await settle(pilot)
        row = screen.rows["r1-on"]
        assert "Vendi 2.50" in str(row.query_one(".run-row--header").render())
        assert "Vendi 2.50" in str(screen.query_one("#history").render())
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
        assert any(c.title == "ESamp on/off (ctrl+e)" for c in app.get_system_commands(screen))


async def test_vendi_failure_is_reported_and_distinct_2_stays(make_app, monkeypatch):
    def broken(texts):
        raise RuntimeError("embedder weights missing")

    monkeypatch.setattr("esamp_tui.diversity.vendi_available", lambda: True)
    monkeypatch.setattr("esamp_tui.diversity.vendi", broken)
    app = make_app(max_tokens=4, prompt="vendi")
    async with app.run_test(size=SIZE) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: any("embedder weights missing" in n.message
                                          for n in app._notifications), what="the Vendi notice")
        await settle(pilot)
        header = str(screen.rows["r1-on"].query_one(".run-row--header").render())
        assert "distinct-2" in header and "Vendi" not in header


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
        await wait_for(pilot, lambda: any(n.message.startswith("Export failed") for n in app._notifications),
                       what="the export failure notice")
        assert screen.record.groups["r1-on"].finished and not screen.exports  # nothing lost
        messages = [n.message for n in app._notifications]
        assert any("is a file, not a folder" in m for m in messages)
