"""The error panel: what failed, what to do, the traceback tail, and which key helps.

Two kinds: the engine has stopped (``fatal``: ctrl+r starts a fresh one), or one run failed and
the engine still serves the next prompt.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Static

from esamp.events import ErrorEvent


class ErrorPanel(Vertical):
    DEFAULT_CSS = """
    ErrorPanel {
        display: none; height: auto; max-height: 16; border: thick $error; background: $error 15%; padding: 0 1;
    }
    ErrorPanel.-visible { display: block; }
    ErrorPanel > .error--message { text-style: bold; color: $text; }
    ErrorPanel > .error--hint { color: $warning; }
    ErrorPanel > VerticalScroll { height: auto; max-height: 8; color: $text-muted; }
    ErrorPanel > .error--keys { color: $text-muted; }
    """

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "engine error"
        self.message = ""
        self.fatal = False

    def compose(self) -> ComposeResult:
        yield Static("", classes="error--message", markup=False)
        yield Static("", classes="error--hint", markup=False)
        with VerticalScroll():
            yield Static("", classes="error--detail", markup=False)
        yield Static("", classes="error--keys", markup=False)

    def show(self, message: str, hint: str = "", detail: str = "", fatal: bool = True) -> None:
        self.message = message
        self.fatal = fatal
        self.border_title = "engine error" if fatal else "run failed"
        keys = (
            "ctrl+r restart the engine · escape hide this panel · transcripts above are kept"
            if fatal
            else "the engine is still running: type another prompt · escape hides this panel"
        )
        self.query_one(".error--keys", Static).update(keys)
        self.query_one(".error--message", Static).update(message)
        self.query_one(".error--hint", Static).update(f"hint: {hint}" if hint else "")
        self.query_one(".error--detail", Static).update(detail.rstrip())
        self.add_class("-visible")
        self.screen.refresh_bindings()  # its key (escape hides it) is offered while it shows

    def report(self, event: ErrorEvent) -> None:
        """The panel for a stopped engine or a failed run; a notice for anything else."""
        if event.fatal or event.group:
            self.show(event.message, event.hint, event.detail, fatal=event.fatal)
        else:
            self.notify(event.message + (f"\nhint: {event.hint}" if event.hint else ""), severity="error", timeout=8)

    def hide(self) -> None:
        self.remove_class("-visible")
        self.screen.refresh_bindings()

    @property
    def visible_now(self) -> bool:
        return self.has_class("-visible")
