"""Ask where to export; the main screen writes the files in a thread worker."""

from __future__ import annotations

from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from esamp_tui.record import default_export_dir


class ExportScreen(ModalScreen[Path | None]):
    DEFAULT_CSS = """
    ExportScreen { align: center middle; }
    ExportScreen > Vertical { width: 80; max-width: 95%; height: auto; border: round $primary; background: $surface; padding: 0 1; }
    ExportScreen Static { color: $text-muted; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel", id="export.cancel")]

    def __init__(self, default: Path | None = None) -> None:
        super().__init__()
        self.default = default or default_export_dir()

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("Export to this folder (created if missing). Enter writes, Esc cancels.\n"
                         "Files: transcript.md, transcript.jsonl (tokens with novelty), "
                         "metrics.jsonl, metrics.csv, screenshot.svg")
            yield Input(str(self.default), id="export-dir")

    @on(Input.Submitted, "#export-dir")
    def submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            self.notify("Give a folder to export to.", severity="warning")
            return
        path = Path(text).expanduser()
        if path.exists() and not path.is_dir():
            self.notify(f"{path} is a file, not a folder: choose another name.", severity="error")
            return
        self.dismiss(path)

    def action_cancel(self) -> None:
        self.dismiss(None)
