"""Help: every key of the main screen, and how to read the panes and charts."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

READING = """
**Panes.** One pane per sample. Each token is coloured by its *novelty*: how far the Distiller's
prediction of the model's deep hidden state missed, normalised within the prompt group
(0.5 = as surprising as the group's recent tokens). Cool colours: expected; hot colours: the
Distiller did not see it coming (the legend is at the right of the status bar). With ESamp off
there is no Distiller and tokens are plain. A pane's bottom border shows its token count, mean
novelty and why the sample ended (stop, length, abort, error).

**Rows and history.** When a run finishes, its row shows *distinct-2*: unique word pairs / all
word pairs over its n samples (1.0 = nothing repeats), and the *Vendi* score over sentence
embeddings (an effective number of different samples, 1 to n) when the offline embedder is
installed (`pip install 'esamp[eval]'`). The history keeps the last runs' numbers, newest first. A run
that was aborted, cut off by the next run or failed is marked and not compared; a complete run
is compared with the latest complete run of the same prompt and sampling steered otherwise
(e.g. `distinct-2 +0.070 vs run 3 (ESamp OFF)`). Compare mode (c) runs ESamp off and on on the
same prompt and seed, in two rows.

**Charts.** tokens/s (ESamp off and on in two colours; the figures on the line above the plot
are the latest run's own rate, its tokens over its time, while the plot follows the engine step
by step), Distiller loss (mean squared error), port hits (tapped rows delivered to the Distiller per
step) and memory in GiB, drawn against the device's total: GPU memory over NVML,
unified/host memory where the device reports none. All four share one time axis, the last two
minutes. On a short terminal they shrink to one line of values and sparklines, and hide when
the panes need the room; g cycles full, one line and hidden.

**Status bar.** Engine, model and device; ESamp, β, mix and n for the next run; what the engine
is doing, and "slow: …" when this run is far below the tokens/s this machine usually reaches
for the same batch.

Single-letter keys act when the prompt box is not focused (the footer shows only the keys that
work where the focus is): Enter runs, Esc leaves the box, p returns. Every action is also in the
command palette (ctrl+p), with a "Mix: …" entry per mix. To change a key, put
`"binding.id" = "key"` lines in `~/.config/esamp/keymap.toml`.
"""


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 90; max-width: 95%; height: 80%; border: round $primary; background: $surface; padding: 0 1;
    }
    """
    BINDINGS = [Binding("escape,q,question_mark,f1", "dismiss", "Close help", id="help.close")]

    def __init__(
        self, bindings: list[Binding], keymap: dict[str, str] | None = None, measured: str | None = None
    ) -> None:
        super().__init__()
        self.key_bindings = bindings
        self.keymap = keymap or {}  # the user's overrides, by binding id
        self.measured = measured  # what committed runs measured for this model and setting

    def compose(self) -> ComposeResult:
        rows = ["| key | action | id (for keymap.toml) |", "|---|---|---|"]
        for b in self.key_bindings:
            key = self.keymap.get(b.id) or b.key_display or b.key.split(",")[0]
            rows.append(f"| `{key}` | {b.tooltip or b.description} | `{b.id}` |")
        rows.append("| `ctrl+p` | command palette (every action, searchable) |")
        rows.append("| `ctrl+q` / `ctrl+c` | quit |")
        with VerticalScroll():
            measured = f"\n**ESamp on this model.** {self.measured}\n" if self.measured else ""
            yield Markdown("# esamp dashboard\n\n" + "\n".join(rows) + "\n" + measured + READING)
