"""Themes as data: TOML files validated, turned into Textual ``Theme`` objects, heat colours included.

Sources, later ones overriding earlier ones of the same name:

1. built-in: the ``esamp_tui.themes`` package (the repository's ``themes/`` folder, shipped in the
   wheel), or that folder itself when running from a checkout;
2. the user's folder: ``$ESAMP_THEME_DIR``, else ``$XDG_CONFIG_HOME/esamp/themes``, else
   ``~/.config/esamp/themes``.

A file that does not parse or validate is skipped and reported (the app shows the report as a
notification and keeps the default theme); it never stops the dashboard.

These themes are the dashboard's one list: ``--theme`` accepts them, ``t`` cycles through them and
the command palette's theme picker offers them (the app unregisters Textual's own themes, which
were not drawn with novelty heat in mind). A user theme file turns any colours into one more.

Heat colours are theme variables ``heat-0`` … ``heat-4`` (low → high novelty) and ``heat-plain``
(tokens with no novelty, ESamp off). Every theme gets defaults for them, so Textual's own themes
work too.
"""

from __future__ import annotations

import importlib.resources
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from textual.color import Color, ColorParseError
from textual.theme import Theme

from esamp.errors import ConfigError

DEFAULT_THEME = "dark"
HEAT_STOPS = 5
HEAT_VARIABLES = [f"heat-{i}" for i in range(HEAT_STOPS)]
HEAT_DEFAULTS = {
    "heat-0": "#6b7a99",
    "heat-1": "#7fb3d5",
    "heat-2": "#e8d36a",
    "heat-3": "#ff9f43",
    "heat-4": "#ff4f6d",
    "heat-plain": "ansi_default",
}
REPO_THEMES = Path(__file__).resolve().parent.parent / "themes"


def _colour(value: str) -> str:
    try:
        Color.parse(value)
    except ColorParseError:
        raise ValueError(f"{value!r} is not a colour (use #rrggbb, rgb(r,g,b) or a colour name)") from None
    return value


class _Colors(BaseModel):
    model_config = ConfigDict(extra="forbid")

    primary: str
    secondary: str | None = None
    accent: str | None = None
    foreground: str | None = None
    background: str | None = None
    surface: str | None = None
    panel: str | None = None
    success: str | None = None
    warning: str | None = None
    error: str | None = None

    @field_validator("*")
    @classmethod
    def _is_colour(cls, value):
        return None if value is None else _colour(value)


class _Heat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stops: list[str] = Field(min_length=HEAT_STOPS, max_length=HEAT_STOPS)
    plain: str | None = None

    @field_validator("stops")
    @classmethod
    def _stops(cls, values):
        return [_colour(v) for v in values]

    @field_validator("plain")
    @classmethod
    def _plain(cls, value):
        return None if value is None else _colour(value)


class ThemeFile(BaseModel):
    """The schema of one ``themes/*.toml`` file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
    dark: bool = True
    colors: _Colors
    heat: _Heat

    def to_theme(self) -> Theme:
        variables = {name: colour for name, colour in zip(HEAT_VARIABLES, self.heat.stops)}
        variables["heat-plain"] = self.heat.plain or self.colors.foreground or HEAT_DEFAULTS["heat-plain"]
        return Theme(name=self.name, dark=self.dark, variables=variables, **self.colors.model_dump(exclude_none=True))


@dataclass(frozen=True)
class ThemeProblem:
    path: str
    reason: str
    theme_name: str = ""  # the name the file gives, when it says one; else the file's stem

    def text(self) -> str:
        return f"theme file {self.path} was skipped: {self.reason}"


def _name_in(origin: str, text: str) -> str:
    try:
        name = tomllib.loads(text).get("name")
    except tomllib.TOMLDecodeError:
        name = None
    return name if isinstance(name, str) and name else Path(origin).stem


def check_theme(name: str, themes: list[Theme], problems: list[ThemeProblem]) -> None:
    """Nothing when ``name`` is one of ``themes``; a ``ConfigError`` saying why not otherwise
    (for a user file that was rejected, the file and its reason)."""
    names = [t.name for t in themes]
    if name in names:
        return
    choices = "choose one of: " + ", ".join(names)
    for problem in problems:
        if name in (problem.theme_name, Path(problem.path).stem):
            raise ConfigError(
                f"theme {name!r} cannot be used: {problem.path} was rejected: {problem.reason}",
                hint=f"fix the file, or {choices}",
            )
    raise ConfigError(f"unknown theme {name!r}", hint=f"{choices}; or add {name}.toml to {user_theme_dir()}")


def user_theme_dir() -> Path:
    if os.environ.get("ESAMP_THEME_DIR"):
        return Path(os.environ["ESAMP_THEME_DIR"]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "esamp" / "themes"


def parse_theme_text(text: str) -> Theme:
    """One TOML document → ``Theme``; raises ``ValueError`` with a reason a user can act on."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"not valid TOML ({exc})") from None
    try:
        return ThemeFile.model_validate(data).to_theme()
    except ValidationError as exc:
        reasons = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "file"
            reasons.append(f"{where}: {err['msg']}")
        raise ValueError("; ".join(reasons)) from None


def _builtin_files() -> list[tuple[str, str]]:
    """(origin, text) of every built-in theme file."""
    found: list[tuple[str, str]] = []
    try:
        root = importlib.resources.files("esamp_tui.themes")
        for entry in sorted(root.iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".toml"):
                found.append((f"esamp_tui.themes/{entry.name}", entry.read_text(encoding="utf-8")))
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError, TypeError):
        pass
    if not found and REPO_THEMES.is_dir():
        for path in sorted(REPO_THEMES.glob("*.toml")):
            found.append((str(path), path.read_text(encoding="utf-8")))
    return found


def load_themes(user_dir: Path | None = None) -> tuple[list[Theme], list[ThemeProblem]]:
    """Built-in themes, then the user's; a bad file becomes a ``ThemeProblem``, never an exception."""
    themes: dict[str, Theme] = {}
    problems: list[ThemeProblem] = []
    sources = list(_builtin_files())
    folder = user_theme_dir() if user_dir is None else user_dir
    if folder.is_dir():
        for path in sorted(folder.glob("*.toml")):
            try:
                sources.append((str(path), path.read_text(encoding="utf-8")))
            except (OSError, UnicodeDecodeError) as exc:
                problems.append(ThemeProblem(str(path), f"cannot be read ({exc})"))
    for origin, text in sources:
        try:
            theme = parse_theme_text(text)
        except ValueError as exc:
            problems.append(ThemeProblem(origin, str(exc), _name_in(origin, text)))
            continue
        themes[theme.name] = theme
    return list(themes.values()), problems


def heat_ramp(variables: dict[str, str], steps: int = 21) -> list[Color]:
    """The heat stops blended into ``steps`` colours, so novelty 0..1 maps to ramp[round(v*(steps-1))]."""
    stops = []
    for name in HEAT_VARIABLES:
        try:
            stops.append(Color.parse(variables.get(name) or HEAT_DEFAULTS[name]))
        except ColorParseError:
            stops.append(Color.parse(HEAT_DEFAULTS[name]))
    ramp = []
    for k in range(steps):
        position = k / (steps - 1) * (len(stops) - 1)
        low = min(int(position), len(stops) - 2)
        ramp.append(stops[low].blend(stops[low + 1], position - low))
    return ramp
