"""One sample's completion, each token coloured by its novelty, drawn through the Line API.

Tokens arrive many times a second in n panes at once. Re-rendering a growing ``Static`` costs more
with every token, so this pane keeps the text as word-wrapped lines of (text, heat bucket) runs
(``esamp_tui.wrap``: a word split over tokens still moves to the next line whole), caches
one ``Strip`` per line and, on an append, drops only the cache entries of the lines that changed
(usually just the last one). A resize re-wraps from the token list; a theme change only empties
the strip cache, since colours are looked up at render time.
"""

from __future__ import annotations

import time

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from esamp_tui.theming import heat_ramp
from esamp_tui.wrap import WrappedLines

PLAIN = -1  # bucket of a token without novelty
# A new border subtitle repaints the whole pane: while tokens stream, its count and mean novelty
# change at most this often (the text itself is drawn on every batch).
HEADER_SECONDS = 1.0
BUCKETS = 21  # novelty 0..1 is drawn in this many colours blended from the theme's five stops


def bucket(novelty: float | None) -> int:
    if novelty is None:
        return PLAIN
    return round(min(max(novelty, 0.0), 1.0) * (BUCKETS - 1))


class SamplePane(ScrollView, can_focus=False):
    DEFAULT_CSS = """
    SamplePane {
        border: round $panel-lighten-2;
        border-title-color: $text-muted;
        border-subtitle-color: $text-muted;
        background: $surface;
        /* No scrollbar while the pane follows its newest line: redrawn on every batch it was a
           quarter of the UI's CPU at 1,000 tok/s. It shows once the reader scrolls back. Its column
           is padding meanwhile, so the wrap width never changes. */
        scrollbar-size-vertical: 0;
        padding-right: 1;
        overflow-x: hidden;
        min-width: 16;
        min-height: 4;
    }
    SamplePane.-reading { scrollbar-size-vertical: 1; padding-right: 0; }
    SamplePane.-finished { border: round $panel-lighten-1; }
    """

    def __init__(self, sample: int, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.sample = sample
        self.tokens: list[tuple[str, int]] = []  # (text, bucket), everything received
        self.novelty_sum = 0.0
        self.novelty_count = 0
        self.finish_reason: str | None = None
        self._wrapped = WrappedLines(0)  # word-wrapped lines of (text, bucket) runs
        self._wrap_width = 0
        self._strips: dict[int, Strip] = {}
        self._styles: dict[int, Style] | None = None
        self._base: Style | None = None  # the pane's own style, under every token
        self._header_due = False  # a later subtitle update is armed
        self._update_header()
        self._header_at = 0.0  # when the subtitle last changed while streaming (monotonic)

    # -- data in ------------------------------------------------------------------------------

    def append(self, pieces: list[tuple[str, float | None]]) -> None:
        """Add tokens (text, novelty) in order; redraw only the lines they touched."""
        if not pieces:
            return
        follow = self.is_vertical_scroll_end
        lines = self._wrapped.lines
        first_dirty = len(lines) - 1  # an append changes only the last line and adds lines after it
        for text, novelty in pieces:
            b = bucket(novelty)
            self.tokens.append((text, b))
            if novelty is not None:
                self.novelty_sum += novelty
                self.novelty_count += 1
            self._wrapped.add(text, b)
        for y in range(first_dirty, len(lines)):
            self._strips.pop(y, None)
        self._set_extent(Size(self._wrap_width, len(lines)))
        wait = self._header_at + HEADER_SECONDS - time.monotonic()
        if wait <= 0:
            self._update_header()
        elif not self._header_due:
            self._header_due = True
            self.set_timer(wait, self._update_header)
        if follow:
            self.scroll_end(animate=False, immediate=True, x_axis=False)
        self.refresh_lines(first_dirty, len(lines) - first_dirty)

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.add_class("-finished")
        self._update_header()

    @property
    def token_count(self) -> int:
        return len(self.tokens)

    @property
    def mean_novelty(self) -> float | None:
        return self.novelty_sum / self.novelty_count if self.novelty_count else None

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.tokens)

    def _update_header(self) -> None:
        self._header_due = False
        self._header_at = time.monotonic()
        # Assigning a border title refreshes the border even when the text is the same: only on a change.
        title = f"sample {self.sample + 1}"
        if self.border_title != title:
            self.border_title = title
        parts = [f"{self.token_count} tok"]
        if self.mean_novelty is not None:
            parts.append(f"nov {self.mean_novelty:.2f}")
        if self.finish_reason:
            parts.append(self.finish_reason)
        subtitle = " · ".join(parts)
        if self.border_subtitle != subtitle:
            self.border_subtitle = subtitle

    def _set_extent(self, size: Size) -> None:
        """Grow the scrollable extent without a layout pass.

        Assigning ``virtual_size`` asks for a layout of the whole screen; with 8 panes gaining lines
        ~10 times a second that relayout (and the full repaint after it) was most of the UI's CPU.
        The pane's own size does not change, only how far it scrolls, so the value is set without
        its watcher and the scrollbars are updated directly. ``_scroll_update`` is Textual's own
        helper for this (8.x); if a later Textual drops it, fall back to the plain assignment.
        """
        if size == self.virtual_size:
            return
        scroll_update = getattr(self, "_scroll_update", None)
        if scroll_update is None or not self.is_mounted:
            self.virtual_size = size
            return
        self.set_reactive(ScrollView.virtual_size, size)
        scroll_update(size)

    @property
    def lines(self) -> list[str]:
        """The text of each wrapped line, as drawn."""
        return self._wrapped.text_lines()

    def _rewrap(self, width: int) -> None:
        self._wrap_width = width
        self._wrapped = WrappedLines(width)
        for text, b in self.tokens:
            self._wrapped.add(text, b)
        self._strips.clear()
        self.virtual_size = Size(width, len(self._wrapped.lines))

    def on_resize(self) -> None:
        width = self.scrollable_content_region.width
        if width != self._wrap_width and width > 0:
            follow = self.is_vertical_scroll_end
            self._rewrap(width)
            if follow:
                self.scroll_end(animate=False, immediate=True, x_axis=False)
            self.refresh()

    def on_mount(self) -> None:
        self.app.theme_changed_signal.subscribe(self, lambda _theme: self.restyle())

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        # Scrolled back from the newest line: reading, with a scrollbar; at the end again: following.
        self.set_class(not self.is_vertical_scroll_end, "-reading")

    def restyle(self) -> None:
        """Forget colours and strips; the next render reads the theme's heat variables again."""
        self._styles = None
        self._base = None
        self._strips.clear()
        self.refresh()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._base = None  # CSS changed (theme, class): the background may have too
        self._strips.clear()

    # -- drawing ------------------------------------------------------------------------------

    def heat_styles(self) -> dict[int, Style]:
        if self._styles is None:
            variables = self.app.theme_variables
            styles = {b: Style(color=colour.rich_color) for b, colour in enumerate(heat_ramp(variables, BUCKETS))}
            styles[BUCKETS - 1] += Style(bold=True)
            plain = variables.get("heat-plain")
            try:
                from textual.color import Color

                styles[PLAIN] = (
                    Style(color=Color.parse(plain).rich_color) if plain and plain != "ansi_default" else Style()
                )
            except Exception:
                styles[PLAIN] = Style()
            self._styles = styles
        return self._styles

    def heat_colour(self, b: int) -> str | None:
        """The colour a bucket is drawn in, as ``#rrggbb`` (tests compare it with the theme)."""
        colour = self.heat_styles()[b].color
        return colour.triplet.hex if colour is not None and colour.triplet is not None else None

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        index = scroll_y + y
        width = self.scrollable_content_region.width
        if self._base is None:
            self._base = self.rich_style
        base = self._base
        lines = self._wrapped.lines
        if index >= len(lines):
            return Strip.blank(width, base)
        if scroll_x or width != self._wrap_width:  # not drawn so in a pane that wraps (overflow-x hidden)
            return self._chained_line(index, base, scroll_x, width)
        strip = self._strips.get(index)
        if strip is None:
            strip = self._strips[index] = self._drawn_line(index, width, base)
        return strip

    def _chained_line(self, index: int, base: Style, x: int, width: int) -> Strip:
        """Line ``index`` through Textual's own strip chain (crop or pad, selection offsets)."""
        styles = self.heat_styles()
        strip = Strip([Segment(text, base + styles[b]) for text, b in self._wrapped.lines[index]])
        return strip.crop_extend(x, x + width, base).apply_offsets(x, index)

    def _drawn_line(self, index: int, width: int, base: Style) -> Strip:
        """Line ``index`` as drawn: its runs, padded to ``width``, with the offsets text selection reads.

        What ``Strip.crop_extend(0, width).apply_offsets(0, index)`` gives, built as one strip: a
        new line or a grown last line is drawn ~40 times a second in each pane at 1,000 tok/s, and
        the three strips of that chain were a tenth of the UI's CPU.
        """
        styles = self.heat_styles()
        segments: list[Segment] = []
        x = cells = 0  # offsets count characters (as apply_offsets does), the width cells
        for text, b in self._wrapped.lines[index]:
            cells += cell_len(text)
            if cells > width:  # a run wider than the pane: let Strip crop it
                return self._chained_line(index, base, 0, width)
            segments.append(Segment(text, base + styles[b] + Style.from_meta({"offset": (x, index)})))
            x += len(text)
        if cells < width:
            segments.append(Segment(" " * (width - cells), base + Style.from_meta({"offset": (x, index)})))
        return Strip(segments, width)
