"""The chart strip: tokens/s (ESamp off and on), Distiller loss, port hits and memory.

The tokens/s figures on the value line are the runs' own rates (``run_rates``: a run's tokens
over its time, set by the screen from the record), one per ESamp state; the plot under them is
the engine's windowed rate, step by step, which falls as a run's samples finish.

Every chart has its unit in its title and a y-scale, and all four share one time axis: the last
``WINDOW_S`` seconds up to the newest reading of any series (the memory sampler ticks every
second, so the axis keeps moving while the engine is idle). Memory is drawn against the device's
total, so 3 GiB of 24 stays low instead of filling the chart. The tokens/s legend sits on the
value line above the plot, never on the data.

Three modes (``mode``): ``full`` (plots), ``compact`` (one line: value and a text sparkline per
chart, for short terminals) and ``hidden``. The screen picks one from the terminal's height
until the user chooses with the charts key.

Data arrives with every step (tens per second); drawing does not. Points go into bounded,
time-stamped series; a timer redraws the plots at 1 Hz (a plotext build costs ~10 ms) with each
series averaged into about one bin per column, and the compact line at 2 Hz.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Iterable

from textual import on, work
from textual.app import ComposeResult
from textual.color import Color, ColorParseError
from textual.containers import Horizontal, Vertical
from textual.markup import escape
from textual.reactive import reactive
from textual.widgets import Static
from textual_plotext import PlotextPlot

from esamp.platform.gpu import GIB, MemorySample, MemorySampler
from esamp_tui.messages import MemorySampled

WINDOW_S = 120.0  # seconds of history on the shared time axis
HITS_STEPS = 16  # the port-hits value: rows per step over this many last steps
TIME_TICKS = [(-120, "-2m"), (-90, "-90s"), (-60, "-1m"), (-30, "-30s"), (0, "now")]
FEW_TIME_TICKS = TIME_TICKS[::2]  # for plots narrower than WIDE_PLOT columns
WIDE_PLOT = 40
MAX_POINTS = 20_000  # per series: minutes of steps even at a fast engine's hundreds per second
MODES = ("full", "compact", "hidden")
SPARK = "▁▂▃▄▅▆▇█"


class TimeSeries:
    """(time, value) points, oldest first, trimmed to the window."""

    def __init__(self) -> None:
        self.points: collections.deque[tuple[float, float]] = collections.deque(maxlen=MAX_POINTS)

    def add(self, at: float, value: float) -> None:
        self.points.append((at, value))
        while self.points and self.points[0][0] < at - 2 * WINDOW_S:
            self.points.popleft()

    @property
    def last_time(self) -> float | None:
        return self.points[-1][0] if self.points else None

    @property
    def last(self) -> float | None:
        return self.points[-1][1] if self.points else None

    def binned(self, now: float, bins: int) -> list[tuple[float, float]]:
        """(seconds before ``now`` as a negative x, mean) for each of ``bins`` bins with data."""
        width = WINDOW_S / max(bins, 1)
        sums: dict[int, list[float]] = {}
        for at, value in self.points:
            k = math.floor((at - (now - WINDOW_S)) / width)
            if 0 <= k < bins or (k == bins and at <= now):
                sums.setdefault(min(k, bins - 1), []).append(value)
        return [((k + 0.5) * width - WINDOW_S, sum(v) / len(v)) for k, v in sorted(sums.items())]

    def values(self, now: float) -> list[float]:
        return [v for at, v in self.points if at >= now - WINDOW_S]

    def mean_of_last(self, count: int) -> float | None:
        """The mean of the last ``count`` values (None: none)."""
        recent = [v for _, v in itertools.islice(reversed(self.points), count)]
        return sum(recent) / len(recent) if recent else None


def segments(points: list[tuple[float, float]], gap: float) -> Iterable[list[tuple[float, float]]]:
    """Split at holes wider than ``gap``, so a line is never drawn across a pause between runs."""
    run: list[tuple[float, float]] = []
    for point in points:
        if run and point[0] - run[-1][0] > gap:
            yield run
            run = []
        run.append(point)
    if run:
        yield run


def spark(values: list[float], low: float, high: float, width: int = 6) -> str:
    """The last ``width`` values as block characters on a fixed [low, high] scale (markup, accent colour)."""
    if not values:
        return " " * width
    span = (high - low) or 1.0
    tail = values[-width:]
    cells = [SPARK[min(max(int((v - low) / span * (len(SPARK) - 1) + 0.5), 0), len(SPARK) - 1)] for v in tail]
    return "[$accent]" + "".join(cells).rjust(width) + "[/]"


class ChartCell(Vertical):
    DEFAULT_CSS = """
    ChartCell { width: 1fr; height: 100%; border: round $panel-lighten-1; border-title-color: $text-muted; }
    ChartCell > .chart--value { height: 1; color: $text; padding: 0 1; }
    ChartCell > PlotextPlot { height: 1fr; }
    """


class ChartStrip(Horizontal):
    DEFAULT_CSS = """
    ChartStrip { height: 10; }
    ChartStrip.-compact { height: 1; background: $panel; }
    ChartStrip.-compact ChartCell { border: none; }
    ChartStrip.-compact ChartCell > .chart--value { padding: 0 1 0 0; }
    ChartStrip.-compact PlotextPlot { display: none; }
    ChartStrip.-hidden { display: none; }
    """
    # (key, title, title when the strip is narrower than 4 × WIDE_PLOT)
    CELLS = [
        ("rate", "tokens/s", "tokens/s"),
        ("loss", "Distiller loss (MSE)", "loss (MSE)"),
        ("hits", "port hits (rows/step)", "hits (rows/step)"),
        ("mem", "memory (GiB)", "memory (GiB)"),
    ]

    mode = reactive("full")

    def __init__(self, memory_sampler: MemorySampler | None = None, id: str | None = None) -> None:
        super().__init__(id=id)
        self.memory_sampler = memory_sampler
        self.rate_off, self.rate_on = TimeSeries(), TimeSeries()
        self.loss, self.hits, self.memory = TimeSeries(), TimeSeries(), TimeSeries()
        self.memory_sample: MemorySample | None = None
        self.run_rates: dict[bool, float] = {}  # ESamp off / on → the latest such run's tokens/s, latest last
        self._dirty = False

    def compose(self) -> ComposeResult:
        for key, title, _ in self.CELLS:
            cell = ChartCell(id=f"chart-{key}")
            cell.border_title = title
            with cell:
                yield Static("–", classes="chart--value", id=f"chart-{key}-value")
                yield PlotextPlot(id=f"chart-{key}-plot")

    def on_mount(self) -> None:
        self.set_interval(1.0, self._draw_plots, name="plots")
        self.set_interval(0.5, self._draw_values, name="values")
        self.redraw()
        if self.memory_sampler is not None:
            self.sample_memory()

    def on_resize(self) -> None:
        for key, title, short in self.CELLS:
            self.query_one(f"#chart-{key}", ChartCell).border_title = (
                title if self.size.width >= 4 * WIDE_PLOT else short
            )
        self.redraw()

    def watch_mode(self, mode: str) -> None:
        for name in MODES:
            self.set_class(mode == name, f"-{name}")
        self.call_after_refresh(self.redraw)

    # -- data in ------------------------------------------------------------------------------

    def add_step(self, at: float, tokens_per_s: float, loss: float | None, port_hits: int, esamp: bool) -> None:
        (self.rate_on if esamp else self.rate_off).add(at, tokens_per_s)
        if loss is not None:
            self.loss.add(at, loss)
        self.hits.add(at, float(port_hits))
        self._dirty = True

    def set_memory(self, sample: MemorySample) -> None:
        self.memory_sample = sample
        if sample.used is not None and sample.total:
            self.memory.add(sample.time, sample.used / GIB)
        self._dirty = True

    @work(thread=True, group="memory", exclusive=True, exit_on_error=False, description="memory sampler")
    def sample_memory(self) -> None:
        """One reading in a thread (NVML calls take milliseconds); the next is armed when it lands."""
        try:
            self.post_message(MemorySampled(self.memory_sampler.sample()))
        except Exception:  # the sampler promises not to raise; if it does, try again later
            self.post_message(MemorySampled(None))

    @on(MemorySampled)
    def memory_sampled(self, message: MemorySampled) -> None:
        message.stop()
        if message.sample is not None:
            self.set_memory(message.sample)
        self.set_timer(1.0 if message.sample else 5.0, self.sample_memory)

    @property
    def now(self) -> float:
        """The right end of the time axis: the newest reading of any series."""
        times = [s.last_time for s in (self.rate_off, self.rate_on, self.loss, self.hits, self.memory)]
        return max((t for t in times if t is not None), default=0.0)

    # -- drawing ------------------------------------------------------------------------------

    def redraw(self) -> None:
        """Draw now instead of at the next tick (after a mode change, or for a screenshot)."""
        self._dirty = True
        self._draw_values()
        self._draw_plots()

    def _colours(self) -> dict[str, tuple[int, int, int]]:
        variables = self.app.theme_variables
        out = {}
        for name, fallback in (("primary", "#5fa8ff"), ("accent", "#ffb454")):
            try:
                out[name] = Color.parse(variables.get(name) or fallback).rgb
            except ColorParseError:
                out[name] = Color.parse(fallback).rgb
        return out

    def _plot(
        self, key: str, series: list[tuple[TimeSeries, tuple[int, int, int]]], ylim: tuple[float, float] | None
    ) -> None:
        widget = self.query_one(f"#chart-{key}-plot", PlotextPlot)
        plt = widget.plt
        plt.clear_data()
        bins = max(widget.size.width - 8, 10)
        plt.xlim(-WINDOW_S, 0)
        ticks = TIME_TICKS if widget.size.width >= WIDE_PLOT else FEW_TIME_TICKS
        plt.xticks([x for x, _ in ticks], [label for _, label in ticks])
        if ylim is not None:
            plt.ylim(*ylim)
        now = self.now
        for data, colour in series:
            for part in segments(data.binned(now, bins), gap=3 * WINDOW_S / bins):
                xs, ys = zip(*part)
                plt.plot(list(xs), list(ys), marker="braille", color=colour)
        widget.refresh()

    def _draw_plots(self) -> None:
        if self.mode != "full" or not self._dirty or not self.is_mounted:
            return
        self._dirty = False
        colours = self._colours()
        now = self.now
        rates = self.rate_off.values(now) + self.rate_on.values(now)
        self._plot(
            "rate",
            [(self.rate_off, colours["primary"]), (self.rate_on, colours["accent"])],
            (0, max(rates, default=1.0) * 1.15 or 1.0),
        )
        self._plot("loss", [(self.loss, colours["accent"])], None)
        self._plot("hits", [(self.hits, colours["accent"])], (0, max(self.hits.values(now), default=1.0) * 1.15 or 1.0))
        total = self.memory_sample.total / GIB if self.memory_sample and self.memory_sample.total else None
        self._plot("mem", [(self.memory, colours["primary"])], (0, total) if total else None)

    def _draw_values(self) -> None:
        if self.mode == "hidden" or not self.is_mounted:
            return
        compact = self.mode == "compact"
        now = self.now
        off, on = self.run_rates.get(False), self.run_rates.get(True)
        rate = (
            " ".join(
                part
                for part in (
                    f"[$primary]━[/] off {off:,.1f}" if off is not None else "",
                    f"[$accent]━[/] on {on:,.1f}" if on is not None else "",
                )
                if part
            )
            or "–"
        )
        loss = "– (ESamp off)" if self.loss.last is None else f"{self.loss.last:.4g}"
        # An engine that reads its records back every few steps (vLLM) reports a step's hits with
        # a later step: rows per step is their mean over the last steps, not the last step's.
        per_step = self.hits.mean_of_last(HITS_STEPS)
        shown = None if per_step is None else round(per_step, 0 if compact else 1)
        hits = "–" if shown is None else f"{shown:g} row{'' if shown == 1 else 's'}"
        sample = self.memory_sample
        mem = escape(sample.label() if sample else "mem N/A")
        narrow = self.size.width < 4 * WIDE_PLOT
        if sample and sample.used is not None and sample.total and (compact or narrow):
            kind = {"gpu": "GPU", "unified": "unified"}.get(sample.kind, "host")
            mem = f"{kind} {sample.used / GIB:.1f}/{sample.total / GIB:.{0 if compact else 1}f} GiB"
        if compact:
            rates = self.rate_off.values(now) + self.rate_on.values(now)
            latest = f"{list(self.run_rates.values())[-1]:,.0f}" if self.run_rates else "–"
            rate = f"tok/s {latest} {spark(rates, 0, max(rates, default=1))}"
            losses = self.loss.values(now)
            loss = "loss –" if not losses else f"loss {losses[-1]:.3g} {spark(losses, min(losses), max(losses))}"
            hit_values = self.hits.values(now)
            hits = f"hits {hits} {spark(hit_values, 0, max(hit_values, default=1))}"
            if sample and sample.used is not None and sample.total:
                mem = f"{mem.replace(' GiB', 'G')} {spark(self.memory.values(now), 0, sample.total / GIB)}"
        for key, text in (("rate", rate), ("loss", loss), ("hits", hits), ("mem", mem)):
            self.query_one(f"#chart-{key}-value", Static).update(text, layout=False)
