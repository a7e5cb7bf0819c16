"""The App: themes, global keys, signals, the command palette. The work happens on ``MainScreen``."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.driver import Driver
from textual.screen import Screen
from textual.theme import BUILTIN_THEMES

from esamp.core.mixes import MIXES
from esamp.errors import ConfigError
from esamp.platform.gpu import MemorySampler
from esamp_tui.keymap import keymap_file, load_keymap
from esamp_tui.options import Options
from esamp_tui.screens.main import MainScreen
from esamp_tui.theming import DEFAULT_THEME, HEAT_DEFAULTS, check_theme, load_themes
from esamp_tui.worker import Backend, Session, SessionSpec

# Closing the terminal (SIGHUP) or ``kill`` (SIGTERM) ends the dashboard as q does: the terminal
# is restored, the worker stopped, its pipes closed. The exit status says which signal it was.
QUIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class EsampApp(App):
    TITLE = "esamp"
    CSS_PATH = "app.tcss"
    BINDINGS = [
        Binding("ctrl+q", "quit", "Quit", show=False, priority=True, id="app.quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True, id="app.quit_ctrl_c"),
    ]

    def __init__(
        self,
        options: Options | None = None,
        backend_factory: Callable[[SessionSpec], Backend] = Session,
        memory_sampler: MemorySampler | None = None,
        theme_dir: Path | None = None,
        keymap_path: Path | None = None,
        speed_file: Path | None = None,
    ) -> None:
        super().__init__()
        self.keymap_path = keymap_path
        self.user_keymap: dict[str, str] = {}
        self.options = options or Options()
        self.backend_factory = backend_factory
        self.memory_sampler = memory_sampler
        self.speed_file = speed_file
        self.main_screen: MainScreen | None = None
        # One theme list: the dashboard's own (built in + the user's files). ``--theme``, ``t``
        # and the palette's theme picker all offer exactly these.
        themes, self.theme_problems = load_themes(theme_dir)
        for theme in themes:
            self.register_theme(theme)
        self.theme_notes = [problem.text() for problem in self.theme_problems]
        wanted = self.options.theme or DEFAULT_THEME
        try:
            check_theme(wanted, themes, self.theme_problems)
        except ConfigError as exc:
            self.theme_notes.append(f"{exc.message}; using {DEFAULT_THEME!r}")
            wanted = DEFAULT_THEME
        self.theme = wanted
        for name in BUILTIN_THEMES:
            if name not in {t.name for t in themes}:
                self.unregister_theme(name)

    def get_driver_class(self) -> type[Driver]:
        """Textual's driver for this platform, or on Linux and macOS the one that survives the
        terminal going away (``esamp_tui.driver``)."""
        driver = super().get_driver_class()
        if sys.platform != "win32":
            from textual.drivers.linux_driver import LinuxDriver

            if driver is LinuxDriver:  # not one that TEXTUAL_DRIVER names
                from esamp_tui.driver import TerminalDriver

                return TerminalDriver
        return driver

    def get_theme_variable_defaults(self) -> dict[str, str]:
        return dict(HEAT_DEFAULTS)

    def get_default_screen(self) -> Screen:
        self.main_screen = MainScreen(self.options, self.backend_factory, self.memory_sampler, self.speed_file)
        return self.main_screen

    def on_mount(self) -> None:
        for note in self.theme_notes:
            self.notify(note, severity="warning", title="theme", timeout=10)
        known = {b.id for b in (*MainScreen.BINDINGS, *self.BINDINGS) if b.id}
        keymap, problems = load_keymap(self.keymap_path or keymap_file(), known)
        for problem in problems:
            self.notify(problem, severity="warning", title="keys", timeout=10)
        if keymap:
            self.user_keymap = keymap
            self.set_keymap(keymap)
        loop = asyncio.get_running_loop()
        for signum in QUIT_SIGNALS:
            loop.add_signal_handler(signum, self.quit_on_signal, signum)

    def quit_on_signal(self, signum: int) -> None:
        self.exit(return_code=128 + signum)

    def on_unmount(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in QUIT_SIGNALS:
            loop.remove_signal_handler(signum)

    def action_next_theme(self) -> None:
        names = list(self.available_themes)
        self.theme = names[(names.index(self.theme) + 1) % len(names)] if self.theme in names else names[0]
        self.notify(f"theme: {self.theme}", timeout=2)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        if not isinstance(screen, MainScreen):
            return
        for binding in screen.BINDINGS:
            if binding.id == "esamp.quit" or binding.key == "escape" or not screen.offers(binding):
                continue  # quit is Textual's own entry; abort only while running, restart after an error
            key = self.user_keymap.get(binding.id) or binding.key_display or binding.key.split(",")[0]
            yield SystemCommand(
                f"{binding.description} ({key})", binding.tooltip, partial(screen.run_from_palette, binding.action)
            )
        for name, mix in MIXES.items():
            yield SystemCommand(
                f"Mix: {name}", f"{mix.formula} (for the next run)", partial(screen.run_from_palette, f"mix({name!r})")
            )
