"""A row of n sample panes for one group (one prompt, ESamp on or off), with its diversity line."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Grid, Vertical
from textual.widgets import Static

from esamp.events import DoneEvent, TokenEvent
from esamp_tui.session_log import INTERRUPTIONS, GroupRecord
from esamp_tui.widgets.sample_pane import SamplePane

PANE_MIN_WIDTH = 26  # below this a pane's text is too narrow to read; the row becomes a grid


class RunRow(Vertical):
    DEFAULT_CSS = """
    RunRow { height: 1fr; min-height: 6; }
    RunRow > .run-row--header { height: 1; padding: 0 1; color: $text-muted; background: $panel; }
    RunRow.-esamp-on > .run-row--header { color: $accent; text-style: bold; }
    RunRow > Grid { grid-gutter: 0 0; height: 1fr; }
    """

    def __init__(self, record: GroupRecord, note: str | None = None) -> None:
        super().__init__(id=f"row-{record.key}", classes="-esamp-on" if record.esamp_on else "-esamp-off")
        self.record = record  # the run's settings and results; this row only draws them
        self.note = note  # what committed measurements say about this setting (compare mode)
        self.group, self.n = record.key, record.n
        self.panes = [SamplePane(i, id=f"pane-{record.key}-{i}") for i in range(record.n)]
        self.vendi_pending = False

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

    @property
    def distinct_2(self) -> float | None:
        return self.record.distinct_2

    def _header_text(self) -> str:
        r = self.record
        text = f"run {r.run_id} · {r.label()} · n={r.n}"
        if r.distinct_2 is not None:
            text += f" · distinct-2 {r.distinct_2:.3f}"
        if r.vendi is not None:
            text += f" · Vendi {r.vendi:.2f}"
        elif self.vendi_pending:
            text += " · Vendi …"
        if r.interrupted:
            text += f" · {INTERRUPTIONS[r.interrupted]}"
        if self.note:
            text += f" · {self.note}"
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

    def set_vendi_pending(self, pending: bool) -> None:
        self.vendi_pending = pending
        self.refresh_header()

    def stopped(self) -> None:
        """The run ended early (the record says why): keep the text, close the open panes."""
        for pane, sample in zip(self.panes, self.record.samples):
            if pane.finish_reason is None and sample.finish_reason is not None:
                pane.finish(sample.finish_reason)
        self.refresh_header()
