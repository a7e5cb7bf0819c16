"""Ask where to export, write the files in a thread, and say where they went.

The screenshot is taken before this dialog opens, so it shows the dashboard, not the dialog. A
folder that cannot be written keeps the dialog open with the reason: nothing is lost, choose
another one.
"""

from __future__ import annotations

from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from esamp_tui.messages import Exported, ExportFailed
from esamp_tui.session_log import SessionRecord, default_export_dir


class ExportScreen(ModalScreen[Exported | None]):
    DEFAULT_CSS = """
    ExportScreen { align: center middle; }
    ExportScreen > Vertical {
        width: 80; max-width: 95%; height: auto; border: round $primary; background: $surface; padding: 0 1;
    }
    ExportScreen Static { color: $text-muted; }
    ExportScreen #export-problem { color: $error; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel", id="export.cancel")]

    def __init__(self, record: SessionRecord, screenshot_svg: str, default: Path | None = None) -> None:
        super().__init__()
        self.record = record
        self.svg = screenshot_svg
        self.default = default or default_export_dir()

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(
                "Export to this folder (created if missing). Enter writes, Esc cancels.\n"
                "Files: transcript.md, transcript.jsonl (tokens with novelty), "
                "metrics.jsonl, metrics.csv, screenshot.svg, screenshot.png"
            )
            yield Input(str(self.default), id="export-dir")
            yield Static("", id="export-problem")

    def problem(self, text: str) -> None:
        self.query_one("#export-problem", Static).update(text)
        self.notify(text, severity="error", timeout=10)

    @on(Input.Submitted, "#export-dir")
    def submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            self.problem("Give a folder to export to.")
            return
        path = Path(text).expanduser()
        if path.exists() and not path.is_dir():
            self.problem(f"{path} is a file, not a folder: choose another name.")
            return
        self.query_one("#export-problem", Static).update("Writing…")
        self.write(path)

    @work(thread=True, exclusive=True, exit_on_error=False, description="export")
    def write(self, directory: Path) -> None:
        try:
            self.post_message(Exported(*self.record.export(directory, self.svg)))
        except Exception as exc:  # a folder that cannot be written: say so, lose nothing
            self.post_message(ExportFailed(f"{type(exc).__name__}: {exc}"))

    @on(Exported)
    def exported(self, message: Exported) -> None:
        self.notify(
            f"Exported {len(message.paths)} files to {message.paths[0].parent}"
            + (f"\n{message.note}" if message.note else ""),
            severity="warning" if message.note else "information",
            timeout=8,
        )
        self.dismiss(message)

    @on(ExportFailed)
    def export_failed(self, message: ExportFailed) -> None:
        self.problem(f"Export failed: {message.error}\nChoose a folder you can write to and press Enter again.")

    def action_cancel(self) -> None:
        self.dismiss(None)
