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
            problems.append(f"key map {path}: no binding has the id {binding_id!r} "
                            f"(ids: {', '.join(sorted(known_ids))})")
        elif not isinstance(keys, str) or not keys.strip():
            problems.append(f"key map {path}: {binding_id!r} needs a key such as \"ctrl+e\", got {keys!r}")
        else:
            keymap[binding_id] = keys.strip()
    return keymap, problems
