"""Fixtures for the dashboard tests: an app on the scripted engine, a fixed memory reading."""

from __future__ import annotations

import asyncio
import time

import pytest

from esamp.core.config import EsampConfig, SamplingConfig
from esamp.platform.gpu import GIB, MemorySample
from esamp_tui.app import EsampApp
from esamp_tui.options import Options

from .fake_engine import FACTORY

# The scripted engine stamps its steps 1,000,000 s + the step number; the memory readings are
# stamped a minute later, so the charts' shared time axis shows the same picture on every run.
FAKE_NOW = 1_000_060.0


class FixedMemory:
    """A memory sampler that always reads the same, so snapshots do not depend on this machine."""

    def sample(self) -> MemorySample:
        return MemorySample("host", 3 * GIB, 8 * GIB, note="test", time=FAKE_NOW)

    def close(self) -> None:
        pass


def fake_options(**values) -> Options:
    """Options on the scripted engine; ESamp and sampling settings by their field names."""
    values = dict(dict(engine_factory=FACTORY, n=4, max_tokens=12, log_file=""), **values)
    sampling = {k: values.pop(k) for k in list(values) if k in SamplingConfig.model_fields}
    esamp = {k: values.pop(k) for k in list(values) if k in EsampConfig.model_fields}
    return Options(esamp=EsampConfig(**esamp), sampling=SamplingConfig(**sampling), **values)


@pytest.fixture
def make_app(tmp_path):
    """Build an ``EsampApp`` on the scripted engine; user themes come from an empty folder."""
    theme_dir = tmp_path / "themes"
    theme_dir.mkdir()

    def build(
        theme_dir=theme_dir, keymap_path=tmp_path / "keymap.toml", speed_file=tmp_path / "speed.json", **values
    ) -> EsampApp:
        return EsampApp(
            fake_options(**values),
            memory_sampler=FixedMemory(),
            theme_dir=theme_dir,
            keymap_path=keymap_path,
            speed_file=speed_file,
        )

    return build


async def wait_for(pilot, predicate, timeout: float = 15.0, what: str = "condition") -> None:
    """Let the app run until ``predicate()`` holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await pilot.pause(0.05)


def run_finished(screen) -> bool:
    groups = screen.record.groups.values()
    return bool(groups) and all(g.finished for g in groups)


async def settle(pilot) -> None:
    """Let the last batch land and the 1 Hz charts redraw."""
    await pilot.pause(0.2)
    await asyncio.sleep(0)


@pytest.fixture(autouse=True)
def no_vendi(monkeypatch):
    """Vendi needs a sentence embedder and seconds of CPU; the dashboard tests leave it out."""
    monkeypatch.setattr("esamp_tui.diversity.vendi_available", lambda: False)
