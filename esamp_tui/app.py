"""The App: themes, global keys, the command palette. The work happens on ``MainScreen``."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable, Iterable

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from esamp.gpu import MemorySampler
from esamp.session import Session, SessionSpec
from esamp_tui.keymap import keymap_file, load_keymap
from esamp_tui.options import Options
from esamp_tui.screens.main import MainScreen
from esamp_tui.theming import DEFAULT_THEME, HEAT_DEFAULTS, load_themes


class EsampApp(App):
    TITLE = "esamp"
    CSS_PATH = "app.tcss"
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", show=False, priority=True, id="app.quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True, id="app.quit_ctrl_c"),
    ]

    def __init__(self, options: Options | None = None,
                 session_factory: Callable[[SessionSpec], Session] = Session,
                 memory_sampler: MemorySampler | None = None, theme_dir: Path | None = None,
                 keymap_path: Path | None = None) -> None:
        super().__init__()
        self.keymap_path = keymap_path
        self.user_keymap: dict[str, str] = {}
        self.options = options or Options()
        self.session_factory = session_factory
        self.memory_sampler = memory_sampler
        self.main_screen: MainScreen | None = None
        themes, self.theme_problems = load_themes(theme_dir)
        for theme in themes:
            self.register_theme(theme)
        self.esamp_theme_names = [t.name for t in themes]
        wanted = self.options.theme or DEFAULT_THEME
        if wanted not in self.available_themes:
            self.theme_problems.append(f"theme {wanted!r} is not installed; using {DEFAULT_THEME!r}")
            wanted = DEFAULT_THEME
        if wanted in self.available_themes:
            self.theme = wanted

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return dict(HEAT_DEFAULTS)

    def get_default_screen(self) -> Screen:
        self.main_screen = MainScreen(self.options, self.session_factory, self.memory_sampler)
        return self.main_screen

    def on_mount(self) -> None:
        for problem in self.theme_problems:
            text = problem if isinstance(problem, str) else problem.text()
            self.notify(text + f"\nThe {self.theme!r} theme is used instead.", severity="warning",
                        title="theme", timeout=10)
        known = {b.id for b in (*MainScreen.BINDINGS, *self.BINDINGS) if b.id}
        keymap, problems = load_keymap(self.keymap_path or keymap_file(), known)
        for problem in problems:
            self.notify(problem, severity="warning", title="keys", timeout=10)
        if keymap:
            self.user_keymap = keymap
            self.set_keymap(keymap)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        if not isinstance(screen, MainScreen):
            return
        for binding in screen.BINDINGS:
            if not binding.id or binding.action.startswith("app.") or not binding.show:
                continue
            name = binding.action.split("(")[0]
            if screen.check_action(name, ()) is not True:
                continue
            key = self.user_keymap.get(binding.id) or binding.key_display or binding.key.split(",")[0]
            yield SystemCommand(f"{binding.description} ({key})", binding.tooltip,
                                partial(screen.run_action, binding.action))
