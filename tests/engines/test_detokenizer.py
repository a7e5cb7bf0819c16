"""The text of sampled tokens: the shortest decode path gives what ``tokenizer.decode`` gives."""

from __future__ import annotations

import random

import pytest

from esamp.engines import models
from esamp.engines.base import IncrementalDetokenizer, text_decoder

TEXT = "The quick brown fox, 漢字 and 🙂 emoji, then\nnew lines  and  spaces. " * 6


@pytest.fixture(scope="module")
def tokenizer(embedded_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models.convert_gguf(embedded_gguf))


def test_the_fast_path_decodes_as_the_tokenizer_does(tokenizer):
    """Random id runs (special ids included, split mid-character) decode the same both ways."""
    assert tokenizer.backend_tokenizer is not None  # the embedded tokenizer takes the fast path
    fast = text_decoder(tokenizer)
    rng = random.Random(0)
    ids = tokenizer(TEXT)["input_ids"]
    specials = list(tokenizer.all_special_ids)
    for _ in range(300):
        start = rng.randrange(len(ids))
        run = ids[start : start + rng.randrange(1, 6)] + rng.sample(specials, k=min(1, len(specials)))
        rng.shuffle(run)
        assert fast(run) == tokenizer.decode(run, skip_special_tokens=True), run


def test_streamed_text_is_the_whole_decode(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.push(i) for i in ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_stand_in_tokenizer_maps_ids_into_its_vocabulary_on_the_fast_path(tokenizer):
    """A random-weight preset's ids run past the lent vocabulary: both paths wrap them alike."""
    stand_in = models.StandInTokenizer(tokenizer)
    size = len(tokenizer)
    ids = [5, size + 17, 3 * size + 200, 42]
    assert text_decoder(stand_in)(ids) == stand_in.decode(ids, skip_special_tokens=True)
    assert text_decoder(stand_in)(ids) == tokenizer.decode([i % size for i in ids], skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    calls = []
    real = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: calls.append(ids) or real(ids, **kw))
    text_decoder(tokenizer)([1, 2])
    assert calls == [[1, 2]]
