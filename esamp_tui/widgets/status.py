"""The status bar: engine, model, device, ESamp state, β, n and what the engine is doing."""

from __future__ import annotations

from dataclasses import dataclass, replace

from textual.markup import escape
from textual.widgets import Static


@dataclass(frozen=True)
class StatusInfo:
    engine: str = "…"
    model: str = "…"
    device: str = "…"
    esamp_on: bool = True
    beta: float = 0.8
    n: int = 4
    state: str = "starting engine"  # starting engine | ready | generating | error | stopped


class StatusBar(Static):
    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; color: $text; padding: 0 1; }
    StatusBar.-error { background: $error 40%; }
    """

    def __init__(self, id: str | None = None) -> None:
        super().__init__("", id=id)
        self.info = StatusInfo()
        self.update(self._text())

    def set(self, **changes) -> None:
        self.info = replace(self.info, **changes)
        self.set_class(self.info.state == "error", "-error")
        self.update(self._text(), layout=False)  # one line, fixed height

    def _text(self) -> str:
        i = self.info
        esamp = f"[b]ESamp ON[/b] β={i.beta:g}" if i.esamp_on else f"[b]ESamp OFF[/b] (β={i.beta:g})"
        where = escape(f"{i.engine} · {i.model} · {i.device}")
        return f"{where} │ {esamp} │ n={i.n} │ {escape(i.state)} │ novelty {HEAT_LEGEND}"


# The heat scale in the theme's own colours ($heat-0 … $heat-4 are theme variables).
HEAT_LEGEND = "0 " + "".join(f"[$heat-{k}]██[/]" for k in range(5)) + " 1"

