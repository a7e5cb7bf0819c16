"""The tokenizer of a converted GGUF: checked, and rebuilt where transformers got it wrong.

A GGUF carries no ``tokenizer.json``, only its vocabulary, scores and a few flags; transformers
builds a fast tokenizer from them when ``convert_gguf`` reads the file. Some releases build a
SentencePiece vocabulary (``tokenizer.ggml.model = "llama"``, Gemma's among them) badly:
transformers 5.17 saves Gemma 3's as a Unigram model that cuts words into single characters and
puts no BOS before the prompt, and the model then decodes " 1 1 1 ..." on every engine, vLLM's
included. ``repair`` rebuilds such a model as the BPE a SentencePiece vocabulary is (merges read
off the vocabulary, earlier tokens first), puts BOS where the header asks for it, and fails
loudly when common words still fall apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from esamp.errors import ModelFormatError

# Words every real vocabulary holds whole; a tokenizer that splits most of them is broken.
PROBE_WORDS = ("the", "of", "and", "is", "number", "water", "capital", "answer")
SPM_SPACE = "\u2581"
BYTE_LEVEL_SPACE = "\u0120"


# The header keys ``GgufVocab.from_header`` reads.
HEADER_KEYS = frozenset(
    {
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.bos_token_id",
    }
)


@dataclass(frozen=True)
class GgufVocab:
    """What a GGUF header says about its tokenizer."""

    model: str  # tokenizer.ggml.model: "llama" (SentencePiece), "gpt2" (byte-level BPE), ...
    tokens: tuple[str, ...]
    has_merges: bool
    bos_id: int | None  # the BOS id when the header asks for BOS before every prompt

    @classmethod
    def from_header(cls, metadata: dict) -> GgufVocab:
        """From the values of ``HEADER_KEYS`` (``esamp.engines.models.gguf_metadata``)."""
        asks_bos = bool(metadata.get("tokenizer.ggml.add_bos_token"))
        return cls(
            model=metadata.get("tokenizer.ggml.model", ""),
            tokens=tuple(metadata.get("tokenizer.ggml.tokens") or ()),
            has_merges="tokenizer.ggml.merges" in metadata,
            bos_id=metadata.get("tokenizer.ggml.bos_token_id") if asks_bos else None,
        )


def spm_bpe_model(tokens: tuple[str, ...] | list[str]) -> dict:
    """The ``model`` of a ``tokenizer.json`` for a SentencePiece-BPE vocabulary without merges.

    Every token that is two tokens of the vocabulary joined gives a merge of those two; a token
    earlier in the file merges first (Gemma's scores do not follow its merge order; its file order
    does), and within one token the split with the longer left part first. Tokens of blanks only
    are stored with spaces but looked up with SentencePiece's ``▁``, so they are respelled.
    """
    spelled = [SPM_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab: dict[str, int] = {}
    for index, token in enumerate(spelled):
        vocab[token] = index
    merges: list[tuple[int, int, str, str]] = []  # (the joined token's index, -len(left), left, right)
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((index, -cut, left, right))
    merges.sort()
    return {
        "type": "BPE",
        "dropout": None,
        "unk_token": "<unk>" if "<unk>" in vocab else None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": True,
        "byte_fallback": True,
        "ignore_merges": False,
        "vocab": vocab,
        "merges": [[left, right] for _, _, left, right in merges],
    }


def _load(directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def split_words(tokenizer, tokens: tuple[str, ...]) -> list[str]:
    """The probe words the vocabulary holds whole that the tokenizer nevertheless cuts."""
    held = set(tokens)
    cut = []
    for word in PROBE_WORDS:
        if not ({SPM_SPACE + word, BYTE_LEVEL_SPACE + word} & held):
            continue
        if len(tokenizer(" " + word, add_special_tokens=False)["input_ids"]) != 1:
            cut.append(word)
    return cut


def _add_bos(directory: Path, bos: str, bos_id: int) -> None:
    """Put ``bos`` before every prompt: a template after the post-processor already there."""
    path = directory / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    special = {"SpecialToken": {"id": bos, "type_id": 0}}
    template = {
        "type": "TemplateProcessing",
        "single": [special, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            special,
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    present = data.get("post_processor")
    if present and present.get("type") != "TemplateProcessing":
        template = {"type": "Sequence", "processors": [present, template]}
    data["post_processor"] = template
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config_path = directory / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["add_bos_token"] = True
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def repair(directory: Path, source: Path, vocab: GgufVocab) -> list[str]:
    """Make the tokenizer saved in ``directory`` (from the GGUF ``source``, whose header says
    ``vocab``) tokenize as the file means: SentencePiece as BPE, BOS where asked. Returns what was
    repaired (empty when nothing was); raises ``ModelFormatError`` when the result still cuts
    common words or drops BOS."""
    repaired = []
    path = directory / "tokenizer.json"
    tokenizer = _load(directory)
    if vocab.model == "llama" and not vocab.has_merges and split_words(tokenizer, vocab.tokens):
        data = json.loads(path.read_text(encoding="utf-8"))
        data["model"] = spm_bpe_model(vocab.tokens)
        path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        repaired.append("SentencePiece vocabulary rebuilt as BPE")
        tokenizer = _load(directory)
    if vocab.bos_id is not None and tokenizer("a")["input_ids"][:1] != [vocab.bos_id]:
        _add_bos(directory, tokenizer.convert_ids_to_tokens(vocab.bos_id), vocab.bos_id)
        repaired.append("BOS added")
        tokenizer = _load(directory)
    cut = split_words(tokenizer, vocab.tokens)
    bos_missing = vocab.bos_id is not None and tokenizer("a")["input_ids"][:1] != [vocab.bos_id]
    if cut or bos_missing:
        what = []
        if cut:
            what.append(f"it cuts words its vocabulary holds whole ({', '.join(cut)})")
        if bos_missing:
            what.append(f"it puts no BOS (id {vocab.bos_id}) before prompts, which the file asks for")
        raise ModelFormatError(
            f"the tokenizer transformers built from {source} is wrong: {'; '.join(what)}",
            hint="upgrade transformers (pip install -U transformers), or convert the model to a "
            "Hugging Face directory with its own tokenizer.json and pass that",
        )
    return repaired
