"""Models named by a Hugging Face hub id, fetched the way vLLM fetches them.

``--model`` takes what vLLM takes: a hub id (``Qwen/Qwen2.5-7B-Instruct``), and the short names
people type (``Qwen2.5-7B``), which name their organisation's repository (``Qwen/Qwen2.5-7B``;
``SHORT_NAMES``). The weights come through huggingface_hub into its cache, as they do for vLLM and
transformers: ``HF_HUB_CACHE``/``HF_HOME``, ``HF_TOKEN`` and ``HF_HUB_OFFLINE`` (or
``TRANSFORMERS_OFFLINE``) mean what they mean there, and a model fetched once is not fetched again
by esamp, vLLM or transformers. What is fetched is what vLLM loads: the configuration and tokenizer
files and one copy of the weights (safetensors where the repository has them, never its GGUF,
ONNX or ``original/`` checkpoints).

A model already whole in the cache is loaded from there without asking the hub (every start
would otherwise wait on the network, and without one on huggingface_hub's retries): it is found
by the cache's own layout (``models--ORG--NAME/refs/REVISION`` → ``snapshots/COMMIT``), and
``hf download ID`` brings a newer revision. A model that is not there is downloaded, or, offline
(``HF_HUB_OFFLINE=1``), the error says that it is not there and how to fetch it.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from esamp.errors import ModelNotFoundError
from esamp.events import LoadingEvent

# The short name's prefix (case-insensitive) → the organisation whose repository it names.
SHORT_NAMES: dict[str, str] = {
    "qwen": "Qwen",
    "qwq": "Qwen",
    "llama-": "meta-llama",
    "meta-llama-": "meta-llama",
    "gemma-": "google",
    "mistral-": "mistralai",
    "mixtral-": "mistralai",
    "ministral-": "mistralai",
    "magistral-": "mistralai",
    "devstral-": "mistralai",
    "phi-": "microsoft",
    "smollm": "HuggingFaceTB",
    "deepseek-": "deepseek-ai",
    "olmo-": "allenai",
    "granite-": "ibm-granite",
    "gpt-oss-": "openai",
}
# A repository id as the hub spells one: ORG/NAME of letters, digits, '-', '_' and '.'.
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
BARE_NAME = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}$")
# Never fetched: checkpoints in formats vLLM does not load from an HF repository.
IGNORED = [
    "original/*",
    "*.gguf",
    "*.onnx",
    "*.onnx_data",
    "onnx/*",
    "*.msgpack",
    "*.h5",
    "*.ot",
    "coreml/*",
    "openvino/*",
    "*.mlmodel",
    "*.tflite",
    "*.pdparams",
]
PYTORCH_WEIGHTS = ["*.bin", "*.pt", "*.pth"]  # skipped where the repository has safetensors (as vLLM does)
PROGRESS_EVERY = 0.25  # seconds between progress reports


def _true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def offline() -> bool:
    """Whether the user told huggingface_hub (or transformers) to stay off the network."""
    return _true("HF_HUB_OFFLINE") or _true("TRANSFORMERS_OFFLINE")


def cache_roots() -> list[Path]:
    """Where huggingface_hub keeps (and looks for) models, the first being where it writes: as it
    reads its environment (``HF_HUB_CACHE``, the older ``HUGGINGFACE_HUB_CACHE``, ``HF_HOME``,
    ``XDG_CACHE_HOME``), then its default."""
    roots = [Path(os.environ[name]) for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE") if os.environ.get(name)]
    if os.environ.get("HF_HOME"):
        roots.append(Path(os.environ["HF_HOME"]) / "hub")
    if os.environ.get("XDG_CACHE_HOME"):
        roots.append(Path(os.environ["XDG_CACHE_HOME"]) / "huggingface" / "hub")
    roots.append(Path.home() / ".cache" / "huggingface" / "hub")
    return list(dict.fromkeys(p.expanduser() for p in roots))


def _repo_folder(root: Path, repo_id: str) -> Path:
    return root / ("models--" + repo_id.replace("/", "--"))


def _cached_repos(name: str) -> list[str]:
    """Repository ids in the caches whose name part is ``name`` (any organisation, any case)."""
    found = []
    suffix = "--" + name.lower()
    for root in cache_roots():
        if root.is_dir():
            for folder in sorted(root.glob("models--*--*")):
                if folder.name.lower().endswith(suffix) and folder.name.count("--") == 2:
                    found.append(folder.name[len("models--") :].replace("--", "/"))
    return list(dict.fromkeys(found))


def repo_id_for(spec: str) -> str | None:
    """The hub repository ``spec`` names, or None when it cannot name one.

    ``ORG/NAME`` is taken as it is. A bare name is the one repository of that name in the local
    cache, else its family's organisation (``SHORT_NAMES``): ``Qwen2.5-7B`` → ``Qwen/Qwen2.5-7B``.
    """
    if REPO_ID.match(spec) and ".." not in spec:
        return spec
    if not BARE_NAME.match(spec):
        return None
    cached = _cached_repos(spec)
    if len(cached) == 1:
        return cached[0]
    lower = spec.lower()
    for prefix, org in SHORT_NAMES.items():
        if lower.startswith(prefix):
            return f"{org}/{spec}"
    return None


def complete(snapshot: Path) -> bool:
    """Whether a cached snapshot holds a whole model: its configuration, and every weight shard
    its index names (an interrupted download leaves shards out; huggingface_hub links a file into
    the snapshot only once it is whole)."""
    if not (snapshot / "config.json").is_file():
        return False
    for index in snapshot.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            return False
        if not all((snapshot / shard).is_file() for shard in shards):
            return False
    return True


def cached_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The cached snapshot of ``repo_id`` at ``revision`` (a branch, a tag or a commit), by the
    cache's own layout, or None. Reads nothing from the network."""
    for root in cache_roots():
        folder = _repo_folder(root, repo_id)
        if not folder.is_dir():  # the hub's ids are case-insensitive; the cache keeps the first spelling
            matches = (
                [f for f in root.glob("models--*") if f.name.lower() == folder.name.lower()] if root.is_dir() else []
            )
            if not matches:
                continue
            folder = matches[0]
        ref = folder / "refs" / revision
        if ref.is_file() or revision != "main":
            snapshots = [folder / "snapshots" / (ref.read_text().strip() if ref.is_file() else revision)]
        else:  # a cache copied without its refs: the newest snapshot stands for main
            snapshots = sorted((folder / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True)
        for snapshot in snapshots:
            if complete(snapshot):
                return snapshot
    return None


def _patterns(files: list[str]) -> list[str]:
    """What not to fetch of a repository holding ``files``: vLLM's choice of one weight format."""
    ignore = list(IGNORED)
    safetensors = [f for f in files if f.endswith(".safetensors") and "/" not in f]
    if safetensors:
        ignore += PYTORCH_WEIGHTS
        if any(not f.startswith("consolidated") for f in safetensors):
            ignore.append("consolidated*.safetensors")  # Mistral's second copy of the same weights
    return ignore


def _progress_class(report: Callable[[LoadingEvent], None], repo_id: str):
    """A tqdm class that hands huggingface_hub's progress to ``report`` (at most every
    ``PROGRESS_EVERY`` seconds, and at the end) and draws nothing. Byte counts are reported as
    the download of ``repo_id``, a count of files as its files."""
    from tqdm.auto import tqdm

    state = {"last": 0.0}

    class Reporting(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115 - closed with the bar
            kwargs["disable"] = False
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            result = super().update(n)
            now = time.monotonic()
            finished = bool(self.total) and self.n >= self.total
            if now - state["last"] >= PROGRESS_EVERY or finished:
                state["last"] = now
                unit = "B" if self.unit == "B" else "files"
                report(
                    LoadingEvent(
                        stage="download",
                        text=f"downloading {repo_id}" + (":" if unit == "files" else ""),
                        done=float(self.n),
                        total=float(self.total or 0),
                        unit=unit,
                    )
                )
            return result

        def close(self):
            fp = self.fp
            super().close()
            try:
                fp.close()
            except Exception:
                pass

    return Reporting


def _network_errors() -> tuple[type[BaseException], ...]:
    """The transport errors of whichever HTTP client this huggingface_hub uses (httpx2 from 2.x,
    httpx in 1.x, requests before): the network is down or the hub is unreachable."""
    import importlib

    found = []
    for module, name in (
        ("httpx2", "TransportError"),
        ("httpx", "TransportError"),
        ("requests", "ConnectionError"),
        ("requests", "Timeout"),
    ):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _not_found(repo_id: str, spec: str, why: str, hint: str) -> ModelNotFoundError:
    where = "" if spec == repo_id else f" ({spec!r} names it)"
    return ModelNotFoundError(f"model {repo_id}{where}: {why}", hint=hint)


def _fetch_hint(repo_id: str) -> str:
    return (
        f"fetch it where the hub is reachable: `hf download {repo_id}` (huggingface_hub's cache; "
        "copy it here or point HF_HUB_CACHE at it), or pass --model with a local model directory"
    )


def fetch(
    repo_id: str,
    spec: str | None = None,
    revision: str = "main",
    progress: Callable[[LoadingEvent], None] | None = None,
) -> Path:
    """The local snapshot of ``repo_id``, downloaded into huggingface_hub's cache if it is not
    there yet (offline: only the cache is read). ``progress`` receives reports while files come
    in. ``ModelNotFoundError`` says why a model cannot be had and what to do."""
    spec = spec or repo_id
    cached = cached_snapshot(repo_id, revision)
    if cached is not None:  # as it was fetched: `hf download` brings a newer revision
        if progress is not None:
            progress(LoadingEvent(stage="download", text=f"{repo_id} is in the local cache"))
        return cached
    if offline():
        raise _not_found(
            repo_id,
            spec,
            "not in the local Hugging Face cache, and HF_HUB_OFFLINE is set, so "
            f"nothing is downloaded (looked in {', '.join(map(str, cache_roots()))})",
            f"unset HF_HUB_OFFLINE to let esamp download it, or {_fetch_hint(repo_id)}",
        )
    from huggingface_hub import HfApi, snapshot_download  # transformers depends on it
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    connection = (OSError, LocalEntryNotFoundError) + _network_errors()
    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now: huggingface_hub reads it once, at import
    try:
        files = HfApi(endpoint=endpoint).list_repo_files(repo_id, revision=revision)
        kwargs = dict(
            revision=revision, cache_dir=str(cache_roots()[0]), ignore_patterns=_patterns(files), endpoint=endpoint
        )
        if progress is not None:
            kwargs["tqdm_class"] = _progress_class(progress, repo_id)
            progress(LoadingEvent(stage="download", text=f"downloading {repo_id} into {cache_roots()[0]}"))
        path = Path(snapshot_download(repo_id, **kwargs))
    except GatedRepoError:
        raise _not_found(
            repo_id,
            spec,
            "the repository is gated: its owner asks you to accept its terms first",
            f"accept them at https://huggingface.co/{repo_id}, then set HF_TOKEN to a token of "
            "that account (or run `hf auth login`)",
        ) from None
    except RepositoryNotFoundError:
        raise _not_found(
            repo_id,
            spec,
            "no such repository on the Hugging Face hub (or it is private), and no such local path",
            "check the name (ORG/NAME, as on huggingface.co); for a "
            "private model set HF_TOKEN; for a local model pass its directory",
        ) from None
    except RevisionNotFoundError:
        raise _not_found(
            repo_id,
            spec,
            f"the repository has no revision {revision!r}",
            "leave the revision out to take its main branch",
        ) from None
    except HfHubHTTPError as exc:
        raise _not_found(
            repo_id, spec, f"the hub answered {exc}", "try again later, or " + _fetch_hint(repo_id)
        ) from None
    except connection as exc:
        if isinstance(exc, OSError) and getattr(exc, "errno", None) == 28:
            raise _not_found(
                repo_id,
                spec,
                f"the disk is full while downloading into {cache_roots()[0]}",
                "free some space, or set HF_HUB_CACHE to a disk with room",
            ) from None
        raise _not_found(
            repo_id,
            spec,
            f"the Hugging Face hub could not be reached ({type(exc).__name__}: "
            f"{str(exc)[:200]}) and the model is not in the local cache",
            "check the network (or HF_ENDPOINT), or " + _fetch_hint(repo_id),
        ) from None
    if progress is not None:
        progress(LoadingEvent(stage="download", text=f"{repo_id} downloaded into {cache_roots()[0]}"))
    return path
