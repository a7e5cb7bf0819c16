"""The run history above the charts: the last runs' numbers, marked where they do not compare.

Newest first: where the terminal leaves the history fewer lines than it has (two on a short
terminal), the latest runs are the ones shown.
"""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

from esamp_tui.session_log import SessionRecord, history_line

HISTORY_LINES = 4


class RunHistory(Static):
    DEFAULT_CSS = """
    RunHistory { height: auto; max-height: 4; padding: 0 1; color: $text-muted; background: $surface; display: none; }
    RunHistory.-shown { display: block; }
    """

    def show(self, record: SessionRecord, lines: int = HISTORY_LINES) -> None:
        """The last ``lines`` runs that ended, newest first."""
        rows = []
        for group in reversed(record.ended()[-lines:]):
            text, mark = history_line(group, record.baseline(group))
            style = "$warning" if group.interrupted else "$success"
            tail = Content.from_markup(f" · [{style}]$mark[/]", mark=mark) if mark else ""
            rows.append(Content.assemble(text, tail))
        self.update(Content("\n").join(rows), layout=True)
        self.set_class(bool(rows), "-shown")
