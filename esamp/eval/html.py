"""The report as one self-contained HTML file: the Markdown report's own text, tables and plots,
with every PNG embedded as a data URI, so a run is shared as a single file.

It converts only the Markdown that ``esamp.eval.report`` writes (headings, paragraphs, lists,
tables, fenced blocks, images, bold and inline code), so the HTML always says what report.md says.
A bold span that starts with a gain's or a loss's mark (``esamp.eval.direction``) is coloured by
it, green for a gain and red for a loss; other bold spans keep the text's colour.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from esamp.eval.direction import MARKS

_IMAGE = re.compile(r"^!\[(?P<alt>[^\]]*)\]\((?P<src>[^)]+)\)$")
_BOLD = re.compile(r"\*\*(.+?)\*\*")
_KIND = {mark: kind for kind, mark in MARKS.items()}  # ▲ -> "gain", the span's CSS class
_MARKED = re.compile(r"\*\*(" + "|".join(map(re.escape, _KIND)) + r") (.+?)\*\*")
_CODE = re.compile(r"`([^`]+)`")

STYLE = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto;
       max-width: 80rem; padding: 0 1rem; color: #1d1d1f; }
h1 { font-size: 1.6rem; } h2 { margin-top: 2.2rem; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .8rem 0; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: .25rem .55rem; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr:nth-child(even) td { background: #fafafa; }
pre { background: #f6f6f6; padding: .7rem; overflow-x: auto; font-size: 12px; }
img { max-width: 100%; border: 1px solid #eee; }
strong.gain { color: #0a7a3c; } strong.loss { color: #c62828; }
"""


def _inline(text: str) -> str:
    text = html.escape(text, quote=False)
    text = _MARKED.sub(lambda m: f'<strong class="{_KIND[m.group(1)]}">{m.group(1)} {m.group(2)}</strong>', text)
    text = _BOLD.sub(r"<strong>\1</strong>", text)
    return _CODE.sub(r"<code>\1</code>", text)


def _image(alt: str, src: str, folder: Path) -> str:
    path = folder / src
    if not path.is_file():
        return f"<p>[{html.escape(alt)}: {html.escape(src)} is missing]</p>"
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<p><img alt="{html.escape(alt)}" src="data:image/png;base64,{data}"></p>'


def _table(lines: list[str]) -> str:
    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]

    header, align, body = cells(lines[0]), cells(lines[1]), [cells(line) for line in lines[2:]]
    numeric = [a.endswith(":") for a in align]
    out = ["<table>", "<tr>" + "".join(f"<th>{_inline(h)}</th>" for h in header) + "</tr>"]
    for row in body:
        tds = []
        for i, c in enumerate(row):
            kind = ' class="num"' if i < len(numeric) and numeric[i] else ""
            tds.append(f"<td{kind}>{_inline(c)}</td>")
        out.append("<tr>" + "".join(tds) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def markdown_to_html(markdown: str, folder: Path) -> str:
    """``markdown`` (as report.md) as a complete HTML page; images are read from ``folder``."""
    lines = markdown.splitlines()
    body: list[str] = []
    title = "esamp eval"
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            body.append("<pre>" + html.escape("\n".join(lines[i + 1 : j])) + "</pre>")
            i = j + 1
            continue
        if line.startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            body.append(_table(lines[i:j]))
            i = j
            continue
        if line.startswith("- "):
            j = i
            while j < len(lines) and lines[j].startswith("- "):
                j += 1
            body.append("<ul>" + "".join(f"<li>{_inline(item[2:])}</li>" for item in lines[i:j]) + "</ul>")
            i = j
            continue
        heading = re.match(r"^(#{1,6}) (.*)$", line)
        image = _IMAGE.match(line.strip())
        if heading:
            level = len(heading.group(1))
            if level == 1:
                title = heading.group(2)
            body.append(f"<h{level}>{_inline(heading.group(2))}</h{level}>")
        elif image:
            body.append(_image(image.group("alt"), image.group("src"), folder))
        elif line.strip():
            body.append(f"<p>{_inline(line)}</p>")
        i += 1
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )
