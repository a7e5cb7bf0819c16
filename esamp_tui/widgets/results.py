"""The results area: one row of sample panes per group of the current run (two in compare mode).

Tokens and dones go into the record and the panes together. When a group ends complete, its
Vendi score is computed in the background (``esamp_tui.diversity``); the ``VendiScored`` message
updates the record and the row, then bubbles on so the screen can refresh the history.
"""

from __future__ import annotations

from collections import defaultdict

from textual import on
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from esamp.core.config import EsampConfig
from esamp.eval.standing import standing
from esamp.events import DoneEvent, Event, TokenEvent
from esamp_tui import diversity
from esamp_tui.messages import VendiScored
from esamp_tui.session_log import GroupRecord, SessionRecord
from esamp_tui.widgets.run_row import RunRow

PLACEHOLDER = (
    "Type a prompt above and press Enter. Each pane is one sample; tokens are coloured by "
    "novelty (how much the Distiller did not see them coming)."
)


class Results(VerticalScroll):
    DEFAULT_CSS = """
    Results { height: 1fr; background: $background; }
    Results:focus { background: $background; }
    Results > #placeholder { color: $text-muted; padding: 1 2; }
    """

    def __init__(self, record: SessionRecord, config: EsampConfig | None = None, id: str | None = None) -> None:
        super().__init__(id=id)
        self.record = record
        self.config = config  # the engine's ESamp settings: which committed cell the compare row reads
        self.rows: dict[str, RunRow] = {}

    def compose(self) -> ComposeResult:
        yield Static(PLACEHOLDER, id="placeholder")

    def show_run(self, groups: list[GroupRecord]) -> None:
        """Replace what is shown with empty rows for ``groups``."""
        self.remove_children()
        # Compare mode (ESamp off and on): the ESamp row says what the committed runs measured
        # for this model and setting, so a narrower ESamp row is no surprise (esamp.eval.standing).
        note = None
        if len(groups) > 1:
            steering = next(g.steering for g in groups if g.esamp_on)
            found = standing(self.record.engine.get("model"), steering, config=self.config)
            note = found.short() if found else None
        self.rows = {g.key: RunRow(g, note if g.esamp_on else None) for g in groups}
        self.mount_all(self.rows.values())

    def apply(self, events: list[Event]) -> tuple[list[GroupRecord], list[Event]]:
        """Put tokens and dones into the record and the panes, in order (a sample's tokens land
        before its done). Returns the groups that ended, and the events that are not for panes."""
        ended: list[GroupRecord] = []
        others: list[Event] = []
        tokens: list[TokenEvent] = []
        for event in events:
            if isinstance(event, TokenEvent):
                tokens.append(event)
                if group := self.record.groups.get(event.group):
                    group.add_token(event)
                continue
            if isinstance(event, DoneEvent):
                # A pane takes its tokens in one append per batch; only a done waits for them
                # (a step event between two steps' tokens does not: a flush per engine step was
                # most of the dashboard's CPU at 1,000 tok/s).
                self.add_tokens(tokens)
                tokens = []
                self.finish(event)
                if (group := self.record.groups.get(event.group)) and group.finish(event):
                    ended.append(group)
                    self.score(group)
            else:
                others.append(event)
        self.add_tokens(tokens)
        return ended, others

    def add_tokens(self, tokens: list[TokenEvent]) -> None:
        """Tokens in arrival order; each pane gets its share in one append."""
        by_pane: dict[tuple[str, int], list[TokenEvent]] = defaultdict(list)
        for token in tokens:
            by_pane[token.group, token.sample].append(token)
        for (key, sample), events in by_pane.items():
            if key in self.rows:
                self.rows[key].add_tokens(sample, events)

    def finish(self, event: DoneEvent) -> None:
        if event.group in self.rows:
            self.rows[event.group].finish_sample(event)

    def stopped(self, groups: list[GroupRecord]) -> None:
        for group in groups:
            if group.key in self.rows:
                self.rows[group.key].stopped()

    def score(self, group: GroupRecord) -> None:
        pending = diversity.vendi_available() and group.complete and all(s.tokens for s in group.samples)
        if row := self.rows.get(group.key):
            row.set_vendi_pending(bool(pending))
        if pending:
            diversity.vendi_in_background(
                [s.text for s in group.samples],
                lambda score, why: self.post_message(VendiScored(group.key, score, why)),
            )

    @on(VendiScored)
    def vendi_scored(self, message: VendiScored) -> None:
        if message.error:
            self.notify(f"Vendi score unavailable: {message.error}", severity="warning")
        elif group := self.record.groups.get(message.key):
            group.vendi = message.score
        if row := self.rows.get(message.key):
            row.set_vendi_pending(False)
