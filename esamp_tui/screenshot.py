"""Screenshots that look like the terminal did, offline: an SVG with local fonts and a PNG beside it.

Textual's SVG (Rich's ``export_svg``) asks for Fira Code from a CDN. Opened without a network it
falls back to whatever the viewer picks, sometimes a proportional font, and some renderers then
drop the spaces at the end of a token's text element ("Hereare three"). ``offline_svg`` removes
the remote font, names local monospace fonts (DejaVu Sans Mono, Menlo, Consolas, ...) and keeps
every space (``xml:space="preserve"``, ``white-space: pre``).

The PNG is rendered by resvg (the ``resvg-py`` wheel: no system library, unlike cairosvg, which
needs the system's cairo) with a monospace font found on this machine: ``$ESAMP_FONT`` (a .ttf,
.otf or .ttc file), else fontconfig's ``monospace``, else a few well-known paths. The machine's
other fonts stay loaded, so glyphs the monospace font lacks (plot markers, CJK) fall back to them.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

from esamp.errors import EsampError

MONO_STACK = '"DejaVu Sans Mono", Menlo, Consolas, "Liberation Mono", "Noto Sans Mono", monospace'
SANS_STACK = '"DejaVu Sans", Helvetica, Arial, sans-serif'

# Where a monospace font usually is when fontconfig is not there to ask (path, family).
KNOWN_FONTS = [
    ("/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf", "DejaVu Sans Mono"),
    ("/usr/share/fonts/TTF/DejaVuSansMono.ttf", "DejaVu Sans Mono"),
    ("/usr/share/fonts/dejavu/DejaVuSansMono.ttf", "DejaVu Sans Mono"),
    ("/usr/share/fonts/truetype/liberation/LiberationMono-Regular.ttf", "Liberation Mono"),
    ("/System/Library/Fonts/Menlo.ttc", "Menlo"),
    ("C:/Windows/Fonts/consola.ttf", "Consolas"),
]


class ScreenshotError(EsampError):
    """A PNG could not be rendered here (the SVG is still written)."""


def offline_svg(svg: str) -> str:
    """Rich's SVG with local fonts only and every space kept."""
    svg = re.sub(r"@font-face\s*\{[^}]*\}", "", svg)
    svg = re.sub(r"font-family:\s*Fira Code,\s*monospace;", f"font-family: {MONO_STACK};", svg)
    svg = re.sub(r"font-family:\s*arial;", f"font-family: {SANS_STACK};", svg)
    svg = svg.replace("</style>", "    text { white-space: pre; }\n    </style>", 1)
    if 'xml:space="preserve"' not in svg:
        svg = svg.replace("<svg ", '<svg xml:space="preserve" ', 1)
    return svg


def font_family(path: Path) -> str | None:
    """The family name in a TrueType/OpenType file (the first font of a .ttc), or None."""
    try:
        data = path.read_bytes()
        offset = struct.unpack(">I", data[12:16])[0] if data[:4] == b"ttcf" else 0
        (tables,) = struct.unpack(">H", data[offset + 4 : offset + 6])
        for k in range(tables):
            tag, _, start, _ = struct.unpack(">4sIII", data[offset + 12 + 16 * k : offset + 28 + 16 * k])
            if tag != b"name":
                continue
            _, count, strings = struct.unpack(">HHH", data[start : start + 6])
            for r in range(count):
                platform, _, _, name_id, length, at = struct.unpack(
                    ">HHHHHH", data[start + 6 + 12 * r : start + 18 + 12 * r]
                )
                if name_id == 1:
                    raw = data[start + strings + at : start + strings + at + length]
                    return raw.decode("utf-16-be" if platform in (0, 3) else "latin-1")
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def monospace_font() -> tuple[Path, str] | None:
    """(file, family) of a monospace font on this machine, or None."""
    if os.environ.get("ESAMP_FONT"):
        path = Path(os.environ["ESAMP_FONT"]).expanduser()
        family = font_family(path) if path.is_file() else None
        return (path, family) if family else None
    if shutil.which("fc-match"):
        try:
            out = subprocess.run(
                ["fc-match", "-f", "%{file}\n%{family[0]}", "monospace"], capture_output=True, text=True, timeout=5
            ).stdout.splitlines()
            if len(out) == 2 and Path(out[0]).is_file():
                return Path(out[0]), out[1]
        except (OSError, subprocess.SubprocessError):
            pass
    for path, family in KNOWN_FONTS:
        if Path(path).is_file():
            return Path(path), family
    return None


def svg_to_png(svg: str) -> bytes:
    """Render a dashboard SVG to PNG bytes; ``ScreenshotError`` says what is missing."""
    try:
        import resvg_py
    except ImportError:
        raise ScreenshotError(
            "no PNG: the resvg-py package is not installed",
            hint="pip install resvg-py (a self-contained wheel), then export again",
        ) from None
    font = monospace_font()
    if font is None:
        where = (
            "ESAMP_FONT does not name a readable font file"
            if os.environ.get("ESAMP_FONT")
            else "no monospace font was found on this machine"
        )
        raise ScreenshotError(
            f"no PNG: {where}",
            hint="install one (e.g. apt-get install fonts-dejavu-core) or set ESAMP_FONT to a .ttf file",
        )
    path, family = font
    try:
        return bytes(
            resvg_py.svg_to_bytes(
                svg_string=offline_svg(svg), font_files=[str(path)], monospace_family=family, sans_serif_family=family
            )
        )
    except ValueError as exc:
        raise ScreenshotError(
            f"no PNG: resvg could not render the screenshot ({exc})", hint="the SVG beside it opens in any browser"
        ) from None
