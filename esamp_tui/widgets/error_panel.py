"""The error panel: what failed, what to do, the traceback tail, and the restart key."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Static


class ErrorPanel(Vertical):
    DEFAULT_CSS = """
    ErrorPanel { display: none; height: auto; max-height: 16; border: thick $error; background: $error 15%; padding: 0 1; }
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

    def compose(self) -> ComposeResult:
        yield Static("", classes="error--message", markup=False)
        yield Static("", classes="error--hint", markup=False)
        with VerticalScroll():
            yield Static("", classes="error--detail", markup=False)
        yield Static("ctrl+r restart the engine · escape hide this panel · transcripts above are kept",
                     classes="error--keys", markup=False)

    def show(self, message: str, hint: str = "", detail: str = "") -> None:
        self.message = message
        self.query_one(".error--message", Static).update(message)
        self.query_one(".error--hint", Static).update(f"hint: {hint}" if hint else "")
        self.query_one(".error--detail", Static).update(detail.rstrip())
        self.add_class("-visible")

    def hide(self) -> None:
        self.remove_class("-visible")

    @property
    def visible_now(self) -> bool:
        return self.has_class("-visible")
