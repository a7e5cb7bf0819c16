"""The tokenizer of a converted GGUF (esamp.engines.gguf_tokenizer): a SentencePiece vocabulary
that transformers saved as a word-cutting Unigram model without BOS (what transformers 5.17 does
with Gemma 3, which then decodes " 1 1 1 ...") is rebuilt as BPE with BOS, a good one is left
alone, and one that cannot be repaired is an error that says what to do."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from esamp.engines import gguf_tokenizer, models
from esamp.engines.gguf_tokenizer import GgufVocab
from esamp.errors import ModelFormatError

SPACE = "\u2581"
# A SentencePiece vocabulary in file order: specials, characters, then pieces as they merge.
TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    SPACE,
    "t",
    "h",
    "e",
    "a",
    "n",
    "d",
    "o",
    "f",
    "i",
    "s",
    "  ",
    "he",
    SPACE + "t",
    SPACE + "the",
    "an",
    SPACE + "a",
    SPACE + "an",
    SPACE + "and",
    SPACE + "o",
    SPACE + "of",
    SPACE + "i",
    SPACE + "is",
)
BOS = 2


def write_unigram(directory, tokens=TOKENS, *, whole_word_score=-100.0):
    """A Gemma-shaped tokenizer.json whose Unigram model prefers single characters (every longer
    piece scores ``whole_word_score``): the broken tokenizer, no BOS."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import Unigram

    vocab = [(t, -1.0 if len(t) == 1 or t.startswith("<") else whole_word_score) for t in tokens]
    tok = Tokenizer(Unigram(vocab, unk_id=3, byte_fallback=False))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.Fuse()])
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>", "<unk>"])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
            }
        )
    )
    return directory


def encode(directory, text, **kw):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)(text, **kw)["input_ids"]


def spm(tokens=TOKENS, bos_id=BOS):
    return GgufVocab(model="llama", tokens=tokens, has_merges=False, bos_id=bos_id)


def test_a_word_cutting_sentencepiece_tokenizer_is_rebuilt_as_bpe_with_bos(tmp_path):
    directory = write_unigram(tmp_path / "tok")
    the = TOKENS.index(SPACE + "the")
    assert encode(directory, " the", add_special_tokens=False) != [the]  # broken as transformers saved it
    repaired = gguf_tokenizer.repair(directory, tmp_path / "model.gguf", spm())
    assert repaired == ["SentencePiece vocabulary rebuilt as BPE", "BOS added"]
    assert encode(directory, " the") == [BOS, the]
    assert encode(directory, " the and is of") == [BOS] + [TOKENS.index(SPACE + w) for w in ("the", "and", "is", "of")]
    assert json.loads((directory / "tokenizer_config.json").read_text())["add_bos_token"] is True
    # a second pass finds nothing to do
    assert gguf_tokenizer.repair(directory, tmp_path / "model.gguf", spm()) == []


def test_bpe_merges_follow_file_order_and_blank_tokens_are_respelled():
    model = gguf_tokenizer.spm_bpe_model(TOKENS)
    assert model["type"] == "BPE" and model["byte_fallback"] and model["unk_token"] == "<unk>"
    assert SPACE * 2 in model["vocab"] and "  " not in model["vocab"]  # a blank token, as SentencePiece spells it
    merges = [tuple(m) for m in model["merges"]]
    assert merges.index(("h", "e")) < merges.index((SPACE, "t")) < merges.index((SPACE + "t", "he"))
    # a token with two splits lists the longer left part first
    assert merges.index((SPACE + "a", "n")) < merges.index((SPACE, "an"))


def test_a_good_tokenizer_is_left_alone(tmp_path):
    directory = write_unigram(tmp_path / "tok", whole_word_score=-0.1)  # whole pieces win: not broken
    before = (directory / "tokenizer.json").read_bytes()
    assert gguf_tokenizer.repair(directory, tmp_path / "model.gguf", spm(bos_id=None)) == []
    assert (directory / "tokenizer.json").read_bytes() == before


def test_bos_only_is_added_where_the_header_asks(tmp_path):
    directory = write_unigram(tmp_path / "tok", whole_word_score=-0.1)
    assert gguf_tokenizer.repair(directory, tmp_path / "model.gguf", spm()) == ["BOS added"]
    assert encode(directory, " of") == [BOS, TOKENS.index(SPACE + "of")]


def test_a_tokenizer_esamp_cannot_repair_is_an_error_that_says_what_to_do(tmp_path):
    directory = write_unigram(tmp_path / "tok")
    byte_level = GgufVocab(model="gpt2", tokens=TOKENS, has_merges=True, bos_id=None)  # not rebuilt
    with pytest.raises(ModelFormatError) as err:
        gguf_tokenizer.repair(directory, tmp_path / "model.gguf", byte_level)
    assert "cuts words its vocabulary holds whole" in str(err.value) and "upgrade transformers" in err.value.hint


def test_the_header_reader_gives_the_embedded_models_vocabulary(embedded_gguf):
    vocab = GgufVocab.from_header(models.gguf_metadata(embedded_gguf, gguf_tokenizer.HEADER_KEYS))
    assert vocab.model == "gpt2" and vocab.has_merges and vocab.bos_id is None
    assert len(vocab.tokens) == 49152 and vocab.tokens[0] == "<|endoftext|>"


def test_a_header_cut_short_is_damaged(tmp_path, embedded_gguf):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(embedded_gguf.read_bytes()[:4096])
    with pytest.raises(ModelFormatError, match="damaged or incomplete"):
        models.gguf_metadata(cut, gguf_tokenizer.HEADER_KEYS)


def test_a_new_converter_redoes_older_conversions(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    key = models._gguf_cache_key(gguf)
    monkeypatch.setattr(models, "CONVERTER_VERSION", models.CONVERTER_VERSION + 1)
    assert models._gguf_cache_key(gguf) != key


@pytest.fixture
def quick_dequantise(monkeypatch):
    """The cache's bookkeeping around a conversion, without transformers' 20 s of dequantising (a
    real conversion runs once per test run: the ``embedded_model`` fixture's)."""

    def written(path: Path, into: Path) -> None:
        (into / "config.json").write_text(json.dumps({"from": path.name}))

    monkeypatch.setattr(models, "dequantise", written)


def test_a_new_conversion_drops_the_older_ones_of_the_same_file(tmp_path, monkeypatch, embedded_gguf, quick_dequantise):
    """Directories converted from the same GGUF by an older esamp go once the new one exists, and
    those of a GGUF that is gone (a deleted virtual environment's); those of other files that are
    still there, and anything without esamp's source note, stay."""
    path = embedded_gguf
    monkeypatch.setenv("ESAMP_CACHE_DIR", str(tmp_path))
    cache = tmp_path / "models"
    cache.mkdir()

    def converted(name, source):
        d = cache / name
        d.mkdir()
        (d / "esamp_source.json").write_text(json.dumps({"gguf": str(source)}))
        return d

    older = converted("SmolLM2-old", path.resolve())
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    other = converted("other-model", tmp_path / "other.gguf")
    orphan = converted("SmolLM2-of-a-deleted-venv", tmp_path / "gone" / "model.gguf")
    mine = cache / "a-users-own-directory"
    mine.mkdir()
    out = models.convert_gguf(path)
    assert out.parent == cache and (out / "config.json").is_file()
    assert not older.exists() and not orphan.exists() and other.exists() and mine.exists()


def test_two_processes_converting_one_gguf_at_once_both_get_the_cached_model(
    tmp_path, monkeypatch, embedded_gguf, quick_dequantise
):
    """Two esamp processes started together (seen on the GPU: two test runs) both convert; the one
    that renames second finds the other's directory in place and uses it, leaving no partial."""
    monkeypatch.setenv("ESAMP_CACHE_DIR", str(tmp_path))
    replace = os.replace

    def the_other_process_first(src, dst):
        Path(dst).mkdir(parents=True)
        for f in Path(src).iterdir():
            shutil.copy(f, Path(dst) / f.name)
        return replace(src, dst)  # the directory is not empty: OSError, as on Linux

    monkeypatch.setattr(models.os, "replace", the_other_process_first)
    out = models.convert_gguf(embedded_gguf)
    assert (out / "config.json").is_file()
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no .partial- left
