"""Word wrap for text that arrives a token at a time.

A token is often part of a word (``halak`` + ``ic``, ``word`` + ``.``), so a line cannot be broken
where a token ends: when a line overflows, it is broken at its last space that leaves the words
before it within the width, and the word being written moves to the next line whole. Only a word
wider than a line is split. The spaces at a break are dropped, as every word processor does.

Lines are lists of (text, style key) runs, so each token keeps its own colour on whichever line
its characters land. An append changes only the last line and adds lines after it, which is what
lets the pane redraw just those. No textual import.
"""

from __future__ import annotations

from collections.abc import Hashable

from rich.cells import cell_len, get_character_cell_size

Run = tuple[str, Hashable]  # (text, style key)


def split_runs(runs: list[Run], cut: int, resume: int) -> tuple[list[Run], list[Run]]:
    """The runs of ``text[:cut]`` and of ``text[resume:]``, ``text`` being the runs joined."""
    head: list[Run] = []
    tail: list[Run] = []
    start = 0
    for text, key in runs:
        end = start + len(text)
        if start < cut:
            head.append((text[: cut - start], key))
        if end > resume:
            tail.append((text[max(resume - start, 0) :], key))
        start = end
    return [r for r in head if r[0]], [r for r in tail if r[0]]


def break_point(text: str, width: int) -> tuple[int, int]:
    """Where an overflowing line breaks: (end of what stays, start of what moves on).

    The last whitespace whose preceding words fit in ``width`` cells; the whitespace itself is
    dropped. Without one (a single word wider than the line) the word is split at the width.
    """
    if text.isascii() and text.isprintable():  # one cell a character, and a space the only blank
        space = text.rfind(" ", 0, width + 1)
        stay = len(text[:space].rstrip()) if space > 0 else 0
        if not stay:
            fit = max(min(len(text), width), 1)
            return fit, fit
        resume = space
        while resume < len(text) and text[resume] == " ":
            resume += 1
        return stay, resume
    return _break_point_by_cells(text, width)


def _break_point_by_cells(text: str, width: int) -> tuple[int, int]:
    """``break_point`` for any text: characters of any cell width, any whitespace."""
    cells = 0
    best: tuple[int, int] | None = None
    fit = 0  # characters that fit, for the hard split
    for i, ch in enumerate(text):
        if ch.isspace() and cells <= width:
            stay = len(text[:i].rstrip())
            if stay:
                best = (stay, i)
        cells += get_character_cell_size(ch)
        if cells <= width:
            fit = i + 1
    if best is None:
        fit = max(fit, 1)  # a character wider than the line still goes somewhere
        return fit, fit
    stay, space = best
    resume = space
    while resume < len(text) and text[resume].isspace():
        resume += 1
    return stay, resume


class WrappedLines:
    """Text word-wrapped to ``width`` cells as it arrives."""

    def __init__(self, width: int) -> None:
        self.width = max(width, 1)
        self.lines: list[list[Run]] = [[]]
        self._used = 0  # cells on the last line

    def add(self, text: str, key: Hashable) -> None:
        for k, part in enumerate(text.split("\n")):
            if k:
                self.lines.append([])
                self._used = 0
            if not part:
                continue
            self.lines[-1].append((part, key))
            self._used += cell_len(part)
            while self._used > self.width:
                self._break_last_line()

    def _break_last_line(self) -> None:
        line = self.lines[-1]
        text = "".join(t for t, _ in line)
        stay, resume = break_point(text, self.width)
        head, tail = split_runs(line, stay, resume)
        self.lines[-1] = head
        self.lines.append(tail)
        self._used = cell_len(text[resume:])

    def text_lines(self) -> list[str]:
        return ["".join(t for t, _ in line) for line in self.lines]
