"""Word wrap of streamed tokens (``esamp_tui.wrap``): words stay whole across token boundaries."""

from __future__ import annotations

import pytest
from rich.cells import cell_len

from esamp_tui.wrap import WrappedLines, break_point

from .fake_engine import WORD_PIECES


def wrap(pieces, width: int) -> list[str]:
    lines = WrappedLines(width)
    for k, piece in enumerate(pieces):
        lines.add(piece, k)
    return lines.text_lines()


def test_a_word_cut_into_tokens_moves_to_the_next_line_whole():
    # "halak" fits at the end of the first line, "halakic" does not
    assert wrap(["The", " rule", " is", " halak", "ic"], 17) == ["The rule is", "halakic"]


def test_punctuation_never_starts_a_line():
    lines = wrap(["It", " is", " old", "."], 6)
    assert lines == ["It is", "old."]
    assert not any(line.startswith((".", ",")) for line in wrap(WORD_PIECES * 3, 11))


def test_a_word_wider_than_the_line_is_split_at_the_width():
    assert wrap(["a", " supercalifragilistic", " b"], 8) == ["a", "supercal", "ifragili", "stic b"]


def test_the_spaces_at_a_break_are_dropped_and_newlines_kept():
    assert wrap(["one", "   two", "\n", "  three"], 7) == ["one", "two", "  three"]


def test_each_token_keeps_its_own_colour_across_the_break():
    lines = WrappedLines(9)
    for key, piece in enumerate(["The", " halak", "ic"]):
        lines.add(piece, key)
    assert lines.lines == [[("The", 0)], [("halak", 1), ("ic", 2)]]


def test_wide_characters_count_their_cells():
    lines = wrap(["日本語の", "文章です"], 6)
    assert lines == ["日本語", "の文章", "です"]
    assert all(cell_len(line) <= 6 for line in lines)


@pytest.mark.parametrize("width", [1, 2, 5, 9, 14, 23, 40])
def test_token_by_token_equals_the_whole_text_at_once(width):
    """However the text is cut into tokens, the lines are the same, and none is too wide."""
    pieces = list(WORD_PIECES) * 4
    streamed = wrap(pieces, width)
    assert streamed == wrap(["".join(pieces)], width)
    assert all(cell_len(line) <= width for line in streamed)
    words = "".join(pieces).split()
    if width >= max(map(len, words)):  # every word fits a line: none is split
        assert [w for line in streamed for w in line.split()] == words


def test_break_point():
    assert break_point("ab cd ef", 5) == (5, 6)  # "ab cd" stays, "ef" moves
    assert break_point("abcdefgh", 5) == (5, 5)  # no space: split at the width
    assert break_point("  abcdefgh", 5) == (5, 5)  # only leading spaces: no word to break after


def test_the_ascii_break_point_is_the_cell_counting_one():
    """Plain ASCII text (most tokens) takes a shortcut: one cell per character, a space the only
    blank. It must break exactly where the general, cell-counting path does."""
    import random

    from esamp_tui.wrap import _break_point_by_cells

    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab  .,x") for _ in range(rng.randint(1, 40)))
        width = rng.randint(1, 30)
        assert break_point(text, width) == _break_point_by_cells(text, width), (text, width)


@pytest.mark.asyncio
async def test_panes_wrap_streamed_tokens_at_word_boundaries(make_app):
    """In the dashboard: narrow panes, a scripted stream of word pieces; no word is cut."""
    from .conftest import run_finished, settle, wait_for

    app = make_app(n=4, max_tokens=60, prompt="words")
    async with app.run_test(size=(80, 40)) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen), what="the run")
        await settle(pilot)
        for pane in screen.results.rows["r1-on"].panes:
            width = pane.scrollable_content_region.width
            words = pane.text.split()
            assert width < 40 and len(pane.lines) > 3
            assert [w for line in pane.lines for w in line.split()] == words
            assert all(cell_len(line) <= width and not line.startswith(".") for line in pane.lines)
            pane_width = width
        await pilot.resize_terminal(60, 40)  # a resize re-wraps from the tokens, by the same rule
        await settle(pilot)
        pane = screen.results.rows["r1-on"].panes[0]
        assert pane.scrollable_content_region.width != pane_width
        assert [w for line in pane.lines for w in line.split()] == pane.text.split()
