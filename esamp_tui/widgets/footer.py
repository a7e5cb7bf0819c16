"""The key footer: Textual's ``Footer`` that never cuts a key off at the right edge.

When the keys that work now do not all fit the terminal's width, the least needed ones are left
out, in the order the screen gives (binding actions), until the rest fit; quit, help and whatever
the moment needs (abort, restart, leaving the prompt box) are never in that list. ``?`` and the
command palette still list every key. The footer is laid out first and then measured, so the
rule holds for any key map, theme or terminal width.
"""

from __future__ import annotations

from collections.abc import Sequence

from textual.widget import Widget
from textual.widgets import Footer, Label


def _actions(widget: Widget) -> set[str]:
    """The actions a footer entry stands for: a key's own, or every key's of a key group."""
    action = getattr(widget, "action", None)
    if isinstance(action, str):
        return {action}
    return {a for child in widget.children for a in _actions(child)}


class KeysFooter(Footer):
    def __init__(self, drop_order: Sequence[str], **options) -> None:
        super().__init__(**options)
        self.drop_order = list(drop_order)  # actions, the first to be left out first
        self._fitted_width = 0
        self._composed = 0  # recompositions so far: a fit scheduled for an older one is dropped

    async def recompose(self) -> None:
        await super().recompose()  # every key that works now, as Textual's footer shows them
        self._composed += 1
        self.call_after_refresh(self.fit, self._composed)

    def on_resize(self) -> None:
        if self.size.width != self._fitted_width:  # wider: keys left out may fit again
            self.call_after_refresh(self.recompose)

    def right_edge(self) -> int:
        """One past the last cell the keys may use: the command-palette key docks itself at the
        right and keeps its own room."""
        right = self.content_region.right
        for child in self.children:
            if child.display and child.styles.dock == "right":
                right = min(right, child.region.x - child.styles.margin.left)
        return right

    def entries(self) -> list[list[Widget]]:
        """The shown entries in order: a key, or a key group with the label that follows it."""
        out: list[list[Widget]] = []
        for child in self.children:
            if not child.display or child.styles.dock != "none":
                continue
            if isinstance(child, Label) and out:
                out[-1].append(child)  # a group's label ("β" after "+ -")
            else:
                out.append([child])
        return out

    def fit(self, composed: int, tries: int = 10, seen: tuple | None = None) -> None:
        """Leave out entries, least needed first, until the rest fit.

        Measured on the footer as laid out with every key: an entry takes the cells from its
        first widget to the next entry's (margins included), so one pass finds what to leave out.
        The keys' compact style lands a frame after they mount, so the layout is measured until
        two frames agree.
        """
        entries = self.entries()
        if composed != self._composed or not entries:
            return
        layout = (self.size.width, tuple(w.region for entry in entries for w in entry))
        laid_out = all(w.region.width for entry in entries for w in entry)
        if tries and (layout != seen or not laid_out):
            self.call_after_refresh(self.fit, composed, tries - 1, layout)
            return
        if not laid_out:
            return
        self._fitted_width = self.size.width
        starts = [entry[0].region.x for entry in entries]
        last = entries[-1][-1]
        ends = starts[1:] + [last.region.right + last.styles.margin.right]
        width = {id(entry[0]): end - start for entry, start, end in zip(entries, starts, ends)}
        excess = ends[-1] - self.right_edge()
        for action in self.drop_order:
            if excess <= 0:
                break
            for entry in entries:
                if entry[0].display and action in _actions(entry[0]):
                    for part in entry:
                        part.display = False
                    excess -= width[id(entry[0])]
