"""The status bar: engine (and why ``auto`` picked it), model, device, ESamp state, β, mix, n, what the
engine is doing (while it starts: a download's or a conversion's progress), the heat legend.

The settings are reactives bound to the screen's (``data_bind``), so the bar follows every
change without being told. On a narrow terminal the engine/model part is shortened first; the
settings, the state and the novelty legend always fit.
"""

from __future__ import annotations

from textual.content import Content
from textual.reactive import reactive
from textual.widget import Widget

from esamp.core.config import SamplingConfig, Steering

# The heat scale in the theme's own colours ($heat-0 … $heat-4 are theme variables).
HEAT_LEGEND = "novelty 0 " + "".join(f"[$heat-{k}]██[/]" for k in range(5)) + " 1"
HEAT_LEGEND_SHORT = "0" + "".join(f"[$heat-{k}]█[/]" for k in range(5)) + "1"


class StatusBar(Widget):
    DEFAULT_CSS = """
    StatusBar { height: 1; background: $panel; color: $text; padding: 0 1; }
    StatusBar.-error { background: $error 40%; }
    StatusBar.-slow { background: $warning 30%; }
    """

    esamp_on = reactive(Steering.model_fields["enabled"].default)
    beta = reactive(Steering.model_fields["beta"].default)
    mix = reactive(Steering.model_fields["mix"].default)
    n = reactive(SamplingConfig.model_fields["n"].default)
    engine = reactive("…")
    engine_reason = reactive("")  # why ``auto`` picked the engine, e.g. "auto: CUDA GPU and vLLM 0.20.0"
    model = reactive("…")
    device = reactive("…")
    state = reactive("starting engine")  # starting engine[: what it is doing] | ready | generating | error
    notice = reactive("")  # e.g. the run is far slower than usual here

    def watch_state(self, state: str) -> None:
        self.set_class(state == "error", "-error")

    def watch_notice(self, notice: str) -> None:
        self.set_class(bool(notice), "-slow")

    def render(self) -> Content:
        esamp = f"[b]ESamp ON[/b] β={self.beta:g}" if self.esamp_on else f"[b]ESamp OFF[/b] (β={self.beta:g})"
        if self.mix != Steering.model_fields["mix"].default:
            esamp += f" {self.mix}"
        state = self.state + (f" · {self.notice}" if self.notice else "")
        width = self.content_size.width
        for legend in (HEAT_LEGEND, HEAT_LEGEND_SHORT):
            right = Content.from_markup(f"{esamp} │ n={self.n} │ $state │ {legend}", state=state)
            if right.cell_length <= width:
                break
        engine = f"{self.engine} ({self.engine_reason})" if self.engine_reason else self.engine
        where = Content(f"{engine} · {self.model} · {self.device}")
        room = width - right.cell_length - 3
        if room < 8:
            return right
        if where.cell_length > room:
            where = where.truncate(room - 1).append("…")
        return Content.assemble(where, " │ ", right)
