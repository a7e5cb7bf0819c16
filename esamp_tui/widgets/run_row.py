"""A row of n sample panes for one group (one prompt, ESamp on or off), with its diversity line."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Grid, Vertical
from textual.widgets import Static

from esamp.events import DoneEvent, TokenEvent
from esamp_tui.widgets.sample_pane import SamplePane

PANE_MIN_WIDTH = 26  # below this a pane's text is too narrow to read; the row becomes a grid


class RunRow(Vertical):
    DEFAULT_CSS = """
    RunRow { height: 1fr; min-height: 6; }
    RunRow > .run-row--header { height: 1; padding: 0 1; color: $text-muted; background: $panel; }
    RunRow.-esamp-on > .run-row--header { color: $accent; text-style: bold; }
    RunRow > Grid { grid-gutter: 0 0; height: 1fr; }
    """

    def __init__(self, group: str, run_id: int, esamp_on: bool, beta: float, n: int) -> None:
        super().__init__(id=f"row-{group}", classes="-esamp-on" if esamp_on else "-esamp-off")
        self.group, self.run_id, self.esamp_on, self.beta, self.n = group, run_id, esamp_on, beta, n
        self.panes = [SamplePane(i, id=f"pane-{group}-{i}") for i in range(n)]
        self.distinct_2: float | None = None
        self.vendi: float | None = None
        self.vendi_pending = False
        self.crashed = False

    def compose(self) -> ComposeResult:
        yield Static(self._header_text(), classes="run-row--header")
        with Grid():
            yield from self.panes

    def on_mount(self) -> None:
        self._fit_columns(self.size.width)
        self.refresh_header()  # results can land between compose and mount (a fast engine)

    def on_resize(self, event) -> None:
        self._fit_columns(event.size.width)

    def _fit_columns(self, width: int) -> None:
        """As many columns as fit, then balanced: 4 panes that fit 3 across go 2 × 2, not 3 + 1."""
        fit = max(1, min(self.n, width // PANE_MIN_WIDTH)) if width else self.n
        rows = -(-self.n // fit)
        columns = -(-self.n // rows)
        grid = self.query_one(Grid)
        grid.styles.grid_size_columns = columns
        grid.styles.grid_size_rows = rows

    def _header_text(self) -> str:
        mode = f"ESamp ON β={self.beta:g}" if self.esamp_on else "ESamp OFF"
        text = f"run {self.run_id} · {mode} · n={self.n}"
        if self.distinct_2 is not None:
            text += f" · distinct-2 {self.distinct_2:.3f}"
        if self.vendi is not None:
            text += f" · Vendi {self.vendi:.2f}"
        elif self.vendi_pending:
            text += " · Vendi …"
        if self.crashed:
            text += " · engine stopped"
        return text

    def refresh_header(self) -> None:
        # Before compose there is no header yet; compose then builds it from the current state.
        for header in self.query(".run-row--header").results(Static):
            header.update(self._header_text(), layout=False)  # one line, fixed height

    def add_tokens(self, sample: int, tokens: list[TokenEvent]) -> None:
        if sample < len(self.panes):
            self.panes[sample].append([(t.text, t.novelty) for t in tokens])

    def finish_sample(self, event: DoneEvent) -> None:
        if event.sample < len(self.panes):
            self.panes[event.sample].finish(event.finish_reason)

    def set_diversity(self, distinct_2: float | None = None, vendi: float | None = None,
                      vendi_pending: bool = False) -> None:
        if distinct_2 is not None:
            self.distinct_2 = distinct_2
        if vendi is not None:
            self.vendi = vendi
        self.vendi_pending = vendi_pending
        self.refresh_header()

    def mark_stopped(self) -> None:
        """The engine died under this row: keep its text, close its open panes."""
        self.crashed = True
        for pane in self.panes:
            if pane.finish_reason is None:
                pane.finish("error")
        self.refresh_header()
