"""``--model`` as vLLM takes it: hub ids and short names, from huggingface_hub's cache or downloaded
into it. No test reaches a hub: a cache folder is built here, or a stand-in hub listens on
127.0.0.1 (``_fake_hub``)."""

import shutil

import pytest

from esamp.engines import hub, models
from esamp.errors import ModelNotFoundError
from esamp.events import LoadingEvent
from tests.engines._fake_hub import COMMIT, FakeHub

REPO = "tiny-org/tiny-llama"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty huggingface_hub cache of this test's own."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for name in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    return cache


def cached_repo(cache, repo: str, source, commit: str = COMMIT):
    """``source``'s files as huggingface_hub stores a downloaded repository."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    return snapshot


@pytest.mark.parametrize(
    "spec, repo",
    [
        ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct"),
        ("Qwen2.5-7B", "Qwen/Qwen2.5-7B"),
        ("QwQ-32B", "Qwen/QwQ-32B"),
        ("Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"),
        ("gemma-3-270m", "google/gemma-3-270m"),
        ("Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"),
        ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        ("DeepSeek-R1-Distill-Qwen-7B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"),
        ("nothing-known", None),
        ("a/b/c", None),
        ("../escape", None),
    ],
)
def test_short_names_name_their_organisations_repository(hub_cache, spec, repo):
    assert hub.repo_id_for(spec) == repo


def test_a_bare_name_in_the_cache_is_that_repository(hub_cache, tiny_llama):
    cached_repo(hub_cache, REPO, tiny_llama)
    assert hub.repo_id_for("tiny-llama") == REPO  # no family prefix: the cache's one repository of that name


def test_a_cached_hub_id_loads_without_a_network(hub_cache, tiny_llama):
    """HF_HUB_OFFLINE=1 (every test's setting): the id is found by the cache's own layout, and the
    reference engine loads and decodes the model by its id."""
    snapshot = cached_repo(hub_cache, REPO, tiny_llama)
    resolved = models.resolve(REPO)
    assert resolved.kind == "hf" and resolved.path == snapshot and resolved.name == REPO

    from esamp.core.config import SamplingConfig
    from esamp.engines import create_engine
    from esamp.engines.base import run

    engine = create_engine("reference", model=REPO, threads=1)
    try:
        assert engine.ready.model == REPO
        events = list(run(engine, "Hello", SamplingConfig(n=2, max_tokens=4, seed=1, ignore_eos=True)))
    finally:
        engine.close()
    assert sum(e.type == "token" for e in events) == 8 and all(
        e.finish_reason == "length" for e in events if e.type == "done"
    )


def test_offline_and_not_cached_says_how_to_fetch_it(hub_cache):
    with pytest.raises(ModelNotFoundError) as info:
        models.resolve("Qwen2.5-7B")
    text = info.value.user_text()
    assert "Qwen/Qwen2.5-7B" in text and "not in the local Hugging Face cache" in text
    assert "HF_HUB_OFFLINE" in text and "hf download Qwen/Qwen2.5-7B" in info.value.hint
    assert str(hub_cache) in text


def test_a_name_that_is_no_path_and_no_hub_id_says_what_to_give(hub_cache, tmp_path):
    with pytest.raises(ModelNotFoundError) as info:
        models.resolve("nothing-known")
    assert "ORG/NAME" in info.value.hint


@pytest.fixture
def online(hub_cache, monkeypatch):
    """The network allowed, and the hub at a stand-in on 127.0.0.1."""
    with FakeHub() as fake:
        go_online(monkeypatch, fake.url)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        yield fake


def test_a_hub_id_is_downloaded_once_as_vllm_fetches_it_with_progress(online, hub_cache, tiny_llama, monkeypatch):
    """What vLLM would load is fetched (config, tokenizer, safetensors) and nothing else: not the
    PyTorch copy of the same weights, Meta's original checkpoint or a GGUF; progress comes as
    ``LoadingEvent``s; the next start finds it in the cache without asking the hub."""
    online.add(
        REPO,
        tiny_llama,
        files={"pytorch_model.bin": b"x" * 1000, "original/consolidated.00.pth": b"y", "tiny.Q4_0.gguf": b"GGUF"},
    )
    seen: list[LoadingEvent] = []
    resolved = models.resolve(REPO, progress=seen.append)
    got = {p.relative_to(resolved.path).as_posix() for p in resolved.path.rglob("*") if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= got
    assert not {"pytorch_model.bin", "original/consolidated.00.pth", "tiny.Q4_0.gguf"} & got
    assert resolved.path == hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert all(e.stage == "download" for e in seen)
    byte_reports = [e for e in seen if e.unit == "B" and e.total]
    weights = (tiny_llama / "model.safetensors").stat().st_size
    assert byte_reports and byte_reports[-1].total >= weights and byte_reports[-1].done == byte_reports[-1].total
    fetched = len(online.downloads)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.resolve(REPO).path == resolved.path and len(online.downloads) == fetched


def test_a_gated_repository_says_how_to_get_access(online, tiny_llama):
    online.add(REPO, tiny_llama)
    online.gated.add(REPO)
    with pytest.raises(ModelNotFoundError) as info:
        models.resolve(REPO)
    assert "gated" in info.value.message and "HF_TOKEN" in info.value.hint


def test_an_unknown_repository_says_so(online):
    with pytest.raises(ModelNotFoundError) as info:
        models.resolve("tiny-org/no-such-model")
    assert "no such repository" in info.value.message and "ORG/NAME" in info.value.hint


def go_online(monkeypatch, endpoint: str) -> None:
    """Let huggingface_hub use the network (it read HF_HUB_OFFLINE once, at its import, with the
    tests' 1), at ``endpoint``, without the seconds it waits between retries."""
    import types

    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(_http, "time", types.SimpleNamespace(sleep=lambda seconds: None))
    monkeypatch.setenv("HF_ENDPOINT", endpoint)


def test_an_unreachable_hub_says_so_and_how_to_fetch_elsewhere(hub_cache, monkeypatch):
    go_online(monkeypatch, "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ModelNotFoundError) as info:
        models.resolve("Qwen/Qwen2.5-7B")
    assert "could not be reached" in info.value.message and "hf download Qwen/Qwen2.5-7B" in info.value.hint


def test_a_whole_cached_model_is_used_without_asking_the_hub(hub_cache, tiny_llama, monkeypatch):
    snapshot = cached_repo(hub_cache, REPO, tiny_llama)
    go_online(monkeypatch, "http://127.0.0.1:9")  # unreachable: it must not be asked
    assert models.resolve(REPO).path == snapshot


def test_an_interrupted_download_is_fetched_again(online, hub_cache, tiny_llama, tmp_path):
    """A cached snapshot whose index names a shard it lacks is not whole: the hub is asked."""
    import json

    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_llama, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00001.safetensors")
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00001.safetensors"}})
    )
    snapshot = cached_repo(hub_cache, REPO, sharded)
    (snapshot / "model-00001-of-00001.safetensors").unlink()
    online.add(REPO, sharded)
    assert models.resolve(REPO).path == snapshot
    assert (snapshot / "model-00001-of-00001.safetensors").is_file()
