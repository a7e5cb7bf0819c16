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
Distiller did not see it coming. With ESamp off there is no Distiller and tokens are plain.
The pane header shows tokens, mean novelty and why the sample ended (stop, length, abort, error).

**Rows.** When a run finishes, its row shows *distinct-2*: unique word pairs / all word pairs over
its n samples (1.0 = nothing repeats), and the *Vendi* score over sentence embeddings (an
effective number of different samples, 1 to n) when the offline embedder is installed
(`pip install 'esamp[eval]'`). The line above the charts keeps the last runs' numbers.
Compare mode (c) runs ESamp off and on on the same prompt and seed, in two rows.

**Charts.** tokens/s (ESamp off and on in two colours), Distiller loss, tapped rows delivered to
the Distiller per step (port hits), and memory: GPU memory over NVML, unified/host memory where
the device reports none, N/A without NVML.

Single-letter keys act when the prompt box is not focused: Enter runs, Esc leaves the box, p returns.
All actions are also in the command palette (ctrl+p). To change a key, put `"binding.id" = "key"`
lines in `~/.config/esamp/keymap.toml`.
"""


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90; max-width: 95%; height: 80%; border: round $primary; background: $surface; padding: 0 1; }
    """
    BINDINGS = [Binding("escape,q,question_mark,f1", "dismiss", "Close help", id="help.close")]

    def __init__(self, bindings: list[Binding]) -> None:
        super().__init__()
        self.key_bindings = bindings

    def compose(self) -> ComposeResult:
        rows = ["| key | action | id (for keymap.toml) |", "|---|---|---|"]
        keymap = getattr(self.app, "user_keymap", {})  # the user's overrides, if any
        for b in self.key_bindings:
            key = keymap.get(b.id) or b.key_display or b.key.split(",")[0]
            rows.append(f"| `{key}` | {b.tooltip or b.description} | `{b.id}` |")
        rows.append("| `ctrl+p` | command palette (every action, searchable) |")
        rows.append("| `ctrl+q` / `ctrl+c` | quit |")
        with VerticalScroll():
            yield Markdown("# esamp dashboard\n\n" + "\n".join(rows) + "\n" + READING)
