"""The dashboard's plain parts, without an app: history marks, screenshots, the speed record, themes."""

from __future__ import annotations

import json

import pytest

from esamp.core.config import SamplingConfig, Steering
from esamp.errors import ConfigError
from esamp.events import DoneEvent, ReadyEvent, StepEvent, TokenEvent
from esamp_tui.screenshot import ScreenshotError, font_family, monospace_font, offline_svg, svg_to_png
from esamp_tui.session_log import SessionRecord, history_line
from esamp_tui.speed import MIN_STEPS, WARMUP_STEPS, SpeedRecord, SpeedWatch
from esamp_tui.theming import check_theme, load_themes
from esamp_tui.widgets.charts import WINDOW_S, TimeSeries, segments, spark


def finished_run(
    record: SessionRecord,
    run_id: int,
    steering: Steering,
    sampling: SamplingConfig,
    reasons=("length", "length"),
    prompt="p",
    words=("a b c", "a b d"),
):
    (group,) = record.new_run(run_id, prompt, steering, sampling, compare=False)
    for sample, (reason, text) in enumerate(zip(reasons, words)):
        for i, word in enumerate(text.split()):
            group.add_token(TokenEvent(group=group.key, sample=sample, index=i, token_id=i, text=word + " "))
        group.finish(DoneEvent(group=group.key, sample=sample, finish_reason=reason, tokens=3))
    return group


def test_history_marks_interrupted_runs_and_compares_like_with_like():
    record = SessionRecord()
    sampling = SamplingConfig(n=2, max_tokens=3)
    on, off = Steering(), Steering(enabled=False)
    first = finished_run(record, 1, on, sampling)
    second = finished_run(record, 2, off, sampling, words=("a b c", "x y z"))
    aborted = finished_run(record, 3, on, sampling, reasons=("abort", "length"))
    other_n = finished_run(record, 4, off, SamplingConfig(n=2, max_tokens=99))
    other_prompt = finished_run(record, 5, on, sampling, prompt="q")
    assert history_line(first, record.baseline(first))[1] == ""  # nothing earlier to compare with
    text, mark = history_line(second, record.baseline(second))
    assert text.startswith("run 2 · ESamp OFF · n=2 · 3 tok/sample · distinct-2")
    assert mark.startswith("distinct-2 +") and mark.endswith("vs run 1 (ESamp ON β=0.8)")
    assert history_line(aborted, record.baseline(aborted))[1] == "aborted: not compared"
    assert record.baseline(other_n) is None and record.baseline(other_prompt) is None
    cut = finished_run(record, 6, on, sampling, reasons=("length", "length"))
    assert record.baseline(cut) is second  # the latest complete run steered otherwise


def test_stopping_a_run_marks_why_and_keeps_its_numbers():
    record = SessionRecord()
    (group,) = record.new_run(1, "p", Steering(), SamplingConfig(n=2), compare=False)
    group.add_token(TokenEvent(group=group.key, sample=0, index=0, token_id=1, text="one two three"))
    assert record.stop_running("cut") == [group] and record.stop_running("cut") == []
    assert group.interrupted == "cut" and not group.complete and group.distinct_2 is not None
    assert history_line(group, None)[1] == "cut off: not compared"
    assert [s.finish_reason for s in group.samples] == ["abort", "abort"]


def test_compare_runs_carry_the_steering_they_ran_with():
    record = SessionRecord()
    groups = record.new_run(4, "p", Steering(beta=1.5, mix="unsharpened"), SamplingConfig(), compare=True)
    assert [g.key for g in groups] == ["r4-off", "r4-on"]
    assert [g.steering.enabled for g in groups] == [False, True]
    assert all(g.steering.beta == 1.5 and g.steering.mix == "unsharpened" for g in groups)
    assert groups[1].label() == "ESamp ON β=1.5 unsharpened" and groups[0].label() == "ESamp OFF"


SVG = (
    '<svg class="rich-terminal" viewBox="0 0 100 40" xmlns="http://www.w3.org/2000/svg">\n<style>\n'
    '@font-face {\n font-family: "Fira Code";\n src: local("FiraCode-Regular"),\n'
    ' url("https://cdnjs.cloudflare.com/x.woff2") format("woff2");\n}\n'
    ".m { font-family: Fira Code, monospace; font-size: 20px; }\n.t { font-family: arial; }\n</style>\n"
    '<rect width="100" height="40" fill="#101010"/>\n'
    '<g class="m"><text x="0" y="20" fill="#ffffff" textLength="60">Here&#160;</text>'
    '<text x="60" y="20" fill="#ffffff" textLength="36">are</text></g>\n</svg>\n'
)


def test_offline_svg_asks_for_no_network_font_and_keeps_spaces():
    svg = offline_svg(SVG)
    assert "url(" not in svg and "@font-face" not in svg and "Fira Code" not in svg
    assert '"DejaVu Sans Mono"' in svg and "monospace" in svg and "arial" not in svg
    assert 'xml:space="preserve"' in svg and "white-space: pre" in svg
    assert "Here&#160;" in svg  # the text itself is untouched


@pytest.mark.skipif(monospace_font() is None, reason="no monospace font on this machine")
def test_png_renders_offline_with_a_local_font():
    pytest.importorskip("resvg_py")
    png = svg_to_png(SVG)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 200
    path, family = monospace_font()
    assert font_family(path) == family


def test_png_without_a_usable_font_says_what_to_do(tmp_path, monkeypatch):
    pytest.importorskip("resvg_py")
    (tmp_path / "not-a-font.ttf").write_bytes(b"hello")
    monkeypatch.setenv("ESAMP_FONT", str(tmp_path / "not-a-font.ttf"))
    with pytest.raises(ScreenshotError) as info:
        svg_to_png(SVG)
    assert "ESAMP_FONT" in info.value.message and ".ttf" in info.value.hint


def step(rows: int, rate: float, esamp: bool = True) -> StepEvent:
    return StepEvent(step=0, rows=rows, tokens_per_s=rate, esamp=esamp)


def test_speed_watch_flags_a_slow_run_of_the_same_shape_only(tmp_path):
    ready = ReadyEvent(engine="reference", model="m", device="cpu")
    record = SpeedRecord.load(ready, tmp_path / "speed.json")
    watch = SpeedWatch(record)
    for _ in range(WARMUP_STEPS + MIN_STEPS):
        assert watch.add(step(4, 100.0)) is None  # nothing recorded yet: nothing to compare with
    watch.end_run()
    record.save()
    again = SpeedWatch(SpeedRecord.load(ready, tmp_path / "speed.json"))
    results = [again.add(step(4, 30.0)) for _ in range(WARMUP_STEPS + MIN_STEPS)]
    assert results[-1] is not None and results[-1].usual == 100.0 and results[-1].now == 30.0
    assert "--threads 1" in results[-1].explain("reference") and "--threads" not in results[-1].explain("vllm")
    other_shape = SpeedWatch(again.record)
    assert all(other_shape.add(step(8, 30.0)) is None for _ in range(WARMUP_STEPS + MIN_STEPS))


def test_speed_record_keeps_other_models_and_survives_a_bad_file(tmp_path):
    path = tmp_path / "speed.json"
    path.write_text("{not json")
    a = SpeedRecord.load(ReadyEvent(engine="reference", model="a", device="cpu"), path)
    assert a.runs == {}
    a.add("4 rows, ESamp on", 50.0)
    a.save()
    b = SpeedRecord.load(ReadyEvent(engine="reference", model="b", device="cpu"), path)
    b.add("4 rows, ESamp on", 70.0)
    b.save()
    data = json.loads(path.read_text())
    assert set(data) == {"reference · a · cpu", "reference · b · cpu"}


def test_time_series_bins_on_a_shared_axis_and_splits_at_pauses():
    series = TimeSeries()
    for t in range(60):
        series.add(1000.0 + t, float(t))
    series.add(1000.0 + 100, 7.0)  # after a pause
    bins = series.binned(now=1100.0, bins=60)
    assert all(-WINDOW_S <= x <= 0 for x, _ in bins) and bins[-1][1] == 7.0
    parts = list(segments(bins, gap=3 * WINDOW_S / 60))
    assert len(parts) == 2
    assert spark([0, 4, 8], 0, 8, width=3) == "[$accent]▁▅█[/]"
    assert spark([3.0, 3.0], 0, 8, width=2) == "[$accent]▄▄[/]"  # memory against its total, not its swings


def test_check_theme_names_the_list_and_the_reason(tmp_path):
    (tmp_path / "broken.toml").write_text('name = "broken"\n[colors]\nprimary = "nope"\n')
    themes, problems = load_themes(tmp_path)
    check_theme("light", themes, problems)
    with pytest.raises(ConfigError) as info:
        check_theme("broken", themes, problems)
    assert "broken.toml was rejected" in info.value.message and "'nope' is not a colour" in info.value.message
    with pytest.raises(ConfigError) as info:
        check_theme("nord", themes, problems)
    assert info.value.message == "unknown theme 'nord'" and "dark, high-contrast, light" in info.value.hint


def test_a_compare_run_is_compared_within_itself():
    record = SessionRecord()
    sampling = SamplingConfig(n=2, max_tokens=3)
    finished_run(record, 1, Steering(), sampling)
    off, on = record.new_run(2, "p", Steering(), sampling, compare=True)
    for group in (off, on):
        for sample in range(2):
            group.finish(DoneEvent(group=group.key, sample=sample, finish_reason="length", tokens=0))
    assert record.baseline(on) is off  # the same prompt and seed, decoded side by side
    assert record.baseline(off).run_id == 1  # the earlier run with ESamp on


def test_a_runs_rate_is_its_tokens_over_its_time():
    record = SessionRecord()
    sampling = SamplingConfig(n=2, max_tokens=3)
    (group,) = record.new_run(1, "p", Steering(), sampling, compare=False)
    group.started = 100.0
    assert group.tokens_per_s(now=101.0) is None and record.run_rates() == {}  # no token yet
    for i in range(3):
        for sample in range(2):
            group.add_token(TokenEvent(group=group.key, sample=sample, index=i, token_id=i, text="a "))
    assert group.tokens_per_s(now=102.0) == pytest.approx(3.0)  # 6 tokens in 2 s, still running
    record.engine_ready(now=101.0)  # a run sent while the engine loaded starts its clock at ready
    assert group.tokens_per_s(now=102.0) == pytest.approx(6.0)
    for sample in range(2):
        group.finish(DoneEvent(group=group.key, sample=sample, finish_reason="length", tokens=3))
    group.ended = 103.0
    assert group.tokens_per_s(now=500.0) == pytest.approx(3.0)  # fixed once it ended
    (off,) = record.new_run(2, "p", Steering(enabled=False), sampling, compare=False)
    off.add_token(TokenEvent(group=off.key, sample=0, index=0, token_id=0, text="a"))
    assert list(record.run_rates()) == [True, False]  # one figure per ESamp state, the latest last
