"""The chart strip: tokens/s (ESamp on vs off), Distiller loss, port hits, memory.

Data arrives with every step (tens per second); drawing does not. Points are appended to bounded
deques and a timer redraws: the two plotext charts at 1 Hz (each build costs ~10 ms here, and
more with more points, so series are downsampled to the plot's width), the sparklines and labels
at 2 Hz. Nothing is redrawn when nothing changed.
"""

from __future__ import annotations

import collections
import math

from textual.app import ComposeResult
from textual.color import Color, ColorParseError
from textual.containers import Horizontal, Vertical
from textual.widgets import Sparkline, Static
from textual_plotext import PlotextPlot

from esamp.gpu import GIB, MemorySample

HISTORY = 600  # points kept per series


def downsample(values: list[float], width: int) -> list[float]:
    """At most ``width`` points: the mean of each bucket (keeps the shape, bounds the build cost)."""
    if width <= 0 or len(values) <= width:
        return values
    step = len(values) / width
    out = []
    for k in range(width):
        chunk = values[int(k * step): max(int((k + 1) * step), int(k * step) + 1)]
        finite = [v for v in chunk if not math.isnan(v)]
        out.append(sum(finite) / len(finite) if finite else math.nan)
    return out


class ChartCell(Vertical):
    DEFAULT_CSS = """
    ChartCell { width: 1fr; height: 100%; border: round $panel-lighten-1; border-title-color: $text-muted; padding: 0 0; }
    ChartCell > .chart--value { height: 1; color: $text; padding: 0 1; }
    ChartCell > Sparkline { height: 1fr; }
    ChartCell > Sparkline > .sparkline--max-color { color: $accent; }
    ChartCell > Sparkline > .sparkline--min-color { color: $primary 60%; }
    ChartCell > PlotextPlot { height: 1fr; }
    """


class ChartStrip(Horizontal):
    DEFAULT_CSS = """
    ChartStrip { height: 9; }
    """

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rate_on: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self.rate_off: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self.loss: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self.hits: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self.memory: collections.deque[float] = collections.deque(maxlen=HISTORY)
        self.memory_sample: MemorySample | None = None
        self.last_rate = self.last_loss = None
        self.last_hits = 0
        self._plots_dirty = self._sparks_dirty = False

    def compose(self) -> ComposeResult:
        cells = [("tokens/s", "rate"), ("Distiller loss", "loss"), ("port hits / step", "hits"),
                 ("memory", "mem")]
        for title, key in cells:
            cell = ChartCell(id=f"chart-{key}")
            cell.border_title = title
            with cell:
                yield Static("–", classes="chart--value", id=f"chart-{key}-value")
                if key in ("rate", "loss"):
                    yield PlotextPlot(id=f"chart-{key}-plot")
                else:
                    yield Sparkline([], id=f"chart-{key}-spark")

    def on_mount(self) -> None:
        self.set_interval(1.0, self._draw_plots, name="plots")
        self.set_interval(0.5, self._draw_sparks, name="sparklines")
        self._draw_plots(force=True)
        self._draw_sparks(force=True)

    # -- data in ------------------------------------------------------------------------------

    def add_step(self, tokens_per_s: float, loss: float | None, port_hits: int, esamp: bool) -> None:
        self.rate_on.append(tokens_per_s if esamp else math.nan)
        self.rate_off.append(math.nan if esamp else tokens_per_s)
        self.loss.append(loss if loss is not None else math.nan)
        self.hits.append(float(port_hits))
        self.last_rate, self.last_hits = tokens_per_s, port_hits
        if loss is not None:
            self.last_loss = loss
        self._plots_dirty = self._sparks_dirty = True

    def set_memory(self, sample: MemorySample) -> None:
        self.memory_sample = sample
        if sample.fraction is not None:
            self.memory.append(sample.used / GIB)
        self._sparks_dirty = True

    # -- drawing ------------------------------------------------------------------------------

    def redraw(self) -> None:
        """Draw everything now instead of at the next tick (after a restore, or for a screenshot)."""
        self._draw_plots(force=True)
        self._draw_sparks(force=True)

    def _draw_plots(self, force: bool = False) -> None:
        if not (self._plots_dirty or force) or not self.is_mounted:
            return
        self._plots_dirty = False
        rate = self.query_one("#chart-rate-plot", PlotextPlot)
        width = max(rate.size.width - 8, 8)
        plt = rate.plt
        plt.clear_data()
        plt.xticks([])  # step numbers say nothing here; the plot is a trend
        off_colour, on_colour = self._series_colours()
        on = downsample(list(self.rate_on), width)
        off = downsample(list(self.rate_off), width)
        xs = list(range(len(on)))
        if any(not math.isnan(v) for v in off):
            plt.plot(xs, off, label="off", marker="braille", color=off_colour)
        if any(not math.isnan(v) for v in on):
            plt.plot(xs, on, label="on", marker="braille", color=on_colour)
        rate.refresh()
        loss_plot = self.query_one("#chart-loss-plot", PlotextPlot)
        lplt = loss_plot.plt
        lplt.clear_data()
        lplt.xticks([])
        loss = downsample(list(self.loss), max(loss_plot.size.width - 8, 8))
        if any(not math.isnan(v) for v in loss):
            lplt.plot(list(range(len(loss))), loss, marker="braille", color=on_colour)
        loss_plot.refresh()
        self.query_one("#chart-rate-value", Static).update(
            "–" if self.last_rate is None else f"{self.last_rate:,.1f} tok/s", layout=False)
        self.query_one("#chart-loss-value", Static).update(
            "– (ESamp off)" if self.last_loss is None else f"{self.last_loss:.4g}", layout=False)

    def _series_colours(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """ESamp-off and ESamp-on series in the theme's primary and accent colours."""
        variables = self.app.theme_variables
        out = []
        for name, fallback in (("primary", "#5fa8ff"), ("accent", "#ffb454")):
            try:
                out.append(Color.parse(variables.get(name) or fallback).rgb)
            except ColorParseError:
                out.append(Color.parse(fallback).rgb)
        return out[0], out[1]

    def _draw_sparks(self, force: bool = False) -> None:
        if not (self._sparks_dirty or force) or not self.is_mounted:
            return
        self._sparks_dirty = False
        hits = self.query_one("#chart-hits-spark", Sparkline)
        hits.data = downsample(list(self.hits), max(hits.size.width, 1))
        rows = "row" if self.last_hits == 1 else "rows"
        self.query_one("#chart-hits-value", Static).update(f"{self.last_hits} {rows}", layout=False)
        mem = self.query_one("#chart-mem-spark", Sparkline)
        mem.data = downsample(list(self.memory), max(mem.size.width, 1))
        sample = self.memory_sample
        self.query_one("#chart-mem-value", Static).update(sample.label() if sample else "mem N/A", layout=False)
