"""User key overrides: ``~/.config/esamp/keymap.toml`` maps binding ids to keys.

    "esamp.toggle" = "E"          # ESamp on/off
    "esamp.export" = "ctrl+s"

Every binding's id is listed in the help screen (``?``). A file that does not parse, or names an
id that does not exist, is reported in the app and ignored; the default keys stay.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from textual.actions import parse
from textual.binding import Binding
from textual.keys import key_to_character
from textual.screen import Screen
from textual.widgets import Input

from esamp.core.mixes import MIXES

BETA_KEYS = Binding.Group("β")
SAMPLE_KEYS = Binding.Group("samples")

# The main screen's keys. The footer shows those with ``show`` that work where the focus is:
# single-character keys type into the prompt box while it has focus, so they are hidden then.
MAIN_BINDINGS = [
    Binding("e", "toggle_esamp", "ESamp", id="esamp.toggle", tooltip="Turn ESamp steering on or off for the next run"),
    Binding("r", "rerun", "Re-run", id="esamp.rerun", tooltip="Run the last prompt again with the same seed"),
    Binding(
        "c",
        "rerun(True)",
        "Compare",
        id="esamp.compare",
        tooltip="Run the last prompt with ESamp off and on at once, in two rows",
    ),
    Binding(
        "plus",
        "beta(1)",
        "β+",
        key_display="+",
        id="esamp.beta_up",
        group=BETA_KEYS,
        tooltip="Raise β for the next run",
    ),
    Binding(
        "minus",
        "beta(-1)",
        "β-",
        key_display="-",
        id="esamp.beta_down",
        group=BETA_KEYS,
        tooltip="Lower β for the next run",
    ),
    Binding("n", "samples(1)", "n+", id="esamp.more_samples", group=SAMPLE_KEYS, tooltip="One more sample per run"),
    Binding(
        "N",
        "samples(-1)",
        "n-",
        key_display="N",
        id="esamp.fewer_samples",
        group=SAMPLE_KEYS,
        tooltip="One sample fewer per run",
    ),
    Binding(
        "m",
        "mix",
        "Mix",
        id="esamp.mix",
        tooltip="Next mix for the next run: " + "; ".join(f"{k} {m.formula}" for k, m in MIXES.items()),
    ),
    Binding("a", "abort", "Abort", id="esamp.abort", tooltip="Stop the running samples"),
    Binding(
        "x",
        "export",
        "Export",
        id="esamp.export",
        tooltip="Write transcript (Markdown, JSONL), metrics (JSONL, CSV) and a screenshot (SVG, PNG)",
    ),
    Binding("g", "charts", "Charts", id="esamp.charts", tooltip="Charts: full, one line, or hidden"),
    Binding("t", "app.next_theme", "Theme", id="esamp.theme", show=False, tooltip="Switch to the next theme"),
    Binding("p", "focus('prompt')", "Prompt", id="esamp.prompt", show=False, tooltip="Type a new prompt"),
    Binding(
        "question_mark,f1",
        "help",
        "Help",
        key_display="?",
        id="esamp.help",
        tooltip="Keys and how to read the panes and charts",
    ),
    Binding("q", "app.quit", "Quit", id="esamp.quit", tooltip="Stop the engine and quit"),
    Binding(
        "ctrl+r",
        "restart",
        "Restart engine",
        id="esamp.restart",
        tooltip="Start a fresh engine process (after an error)",
    ),
    Binding(
        "escape",
        "focus('results')",
        "Keys",
        key_display="esc",
        id="esamp.leave_prompt",
        tooltip="Leave the prompt box, so the single-letter keys work",
    ),
    Binding(
        "escape", "hide_error", "Hide error", key_display="esc", id="esamp.hide_error", tooltip="Hide the error panel"
    ),
]


# Where the keys that work now do not all fit the footer's width, these are left out first
# (binding ids). Quit, help, abort, restart and leaving the prompt box always stay.
FOOTER_DROP_ORDER = (
    "esamp.charts",
    "esamp.export",
    "esamp.compare",
    "esamp.mix",
    "esamp.more_samples",
    "esamp.rerun",
    "esamp.beta_up",
    "esamp.toggle",
)


def footer_drop_actions() -> list[str]:
    """``FOOTER_DROP_ORDER`` as the actions the footer's keys carry."""
    by_id = {b.id: b.action for b in MAIN_BINDINGS}
    return [by_id[binding_id] for binding_id in FOOTER_DROP_ORDER]


def types_text(key: str) -> bool:
    """True when ``key`` is a character: in a text box it types instead of acting."""
    character = key_to_character(key) or {"plus": "+", "minus": "-"}.get(key)
    return bool(character) and len(character) == 1 and character.isprintable()


def keymap_file() -> Path:
    if os.environ.get("ESAMP_KEYMAP"):
        return Path(os.environ["ESAMP_KEYMAP"]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "esamp" / "keymap.toml"


def load_keymap(path: Path, known_ids: set[str]) -> tuple[dict[str, str], list[str]]:
    """(id → key string, problems). A missing file is no problem and no keymap."""
    if not path.is_file():
        return {}, []
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        return {}, [f"key map {path} was ignored: {exc}"]
    keymap, problems = {}, []
    for binding_id, keys in data.items():
        if binding_id not in known_ids:
            problems.append(
                f"key map {path}: no binding has the id {binding_id!r} (ids: {', '.join(sorted(known_ids))})"
            )
        elif not isinstance(keys, str) or not keys.strip():
            problems.append(f'key map {path}: {binding_id!r} needs a key such as "ctrl+e", got {keys!r}')
        else:
            keymap[binding_id] = keys.strip()
    return keymap, problems


class KeysScreen(Screen):
    """A screen whose character keys step aside while a text box has the focus.

    There the keys type, so their actions are off and the footer does not offer them; the
    command palette still runs them (``run_from_palette``), as the user chose them there.
    """

    palette_call = False

    @property
    def typing(self) -> bool:
        return isinstance(self.focused, Input) and not self.palette_call

    def offers(self, binding: Binding) -> bool:
        """Whether the palette lists ``binding`` now (its action applies, wherever the focus is)."""
        namespace, name, parameters = parse(binding.action)
        if namespace:
            return True
        self.palette_call = True
        try:
            return self.check_action(name, parameters) is not False
        finally:
            self.palette_call = False

    async def run_from_palette(self, action: str) -> None:
        self.palette_call = True
        try:
            await self.run_action(action)
        finally:
            self.palette_call = False

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # Off means hidden, not greyed out: the footer stays short and says only what works.
        return not (
            self.typing
            and any(types_text(key) for key, binding in self._bindings if binding.action.split("(")[0] == action)
        )
