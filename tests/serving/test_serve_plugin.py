"""What a served engine adds and how it gets there (``esamp.serving.plugin``): a vLLM general plugin
that only ``esamp serve``'s processes see, whose step starts the rank's side channel on the worker
that owns the Distiller bank and puts off stop signals on every worker. No engine needed."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from esamp.engines.vllm import plugin as engine_plugin
from esamp.serving import plugin
from esamp.serving.channel import CHANNEL_SECRET_ENV, SECRET_HEADER

ROOT = Path(__file__).resolve().parents[2]
GENERAL = "vllm.general_plugins"
LIST_PLUGINS = f"from importlib.metadata import entry_points; print([e.value for e in entry_points(group={GENERAL!r})])"


def test_the_serving_plugin_is_seen_only_where_esamp_serve_puts_it():
    text = next(plugin.SCOPE.glob("*.dist-info")).joinpath("entry_points.txt").read_text()
    assert f"[{GENERAL}]" in text and f"= {plugin.ENTRY}" in text
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plain = subprocess.run([sys.executable, "-c", LIST_PLUGINS], env=env, capture_output=True, text=True, check=True)
    assert plugin.ENTRY not in plain.stdout  # an engine of the library's, or anyone's: not there
    served = engine_plugin.scope_env(env, scopes=(engine_plugin.SCOPE, plugin.SCOPE))
    found = subprocess.run([sys.executable, "-c", LIST_PLUGINS], env=served, capture_output=True, text=True, check=True)
    assert plugin.ENTRY in found.stdout


def test_esamp_serve_puts_both_scopes_on_its_servers_path():
    pytest.importorskip("vllm")
    from esamp.commands.serve import build, configure

    p = argparse.ArgumentParser()
    configure(p)
    args, rest = p.parse_known_args(["qwen2.5-0.5b:dummy"])
    path = build(args, rest).env["PYTHONPATH"].split(os.pathsep)
    assert path[:2] == [str(engine_plugin.SCOPE), str(plugin.SCOPE)]


class Steering:
    """What the serving step reads of an engine's steering."""

    def __init__(self, owner: bool, config: object = True) -> None:
        self.config = config  # anything but None: the engine runs ESamp
        self.tp = SimpleNamespace(owner=owner)

    def metrics(self) -> dict:
        return {"port_hits": 4}

    def drain(self, release, groups):
        return {"steps": [], "pending": 0}


def _config(port: int | None) -> SimpleNamespace:
    server = {"records_requested": True, "host": "127.0.0.1", "port": port} if port else None
    return SimpleNamespace(
        additional_config={"esamp": {}, **({"esamp_server": json.dumps(server)} if server else {})},
        parallel_config=SimpleNamespace(data_parallel_index=0),
    )


@pytest.mark.parametrize("owner", [True, False], ids=["owns-the-bank", "tp-worker"])
def test_a_served_engine_has_its_channel_on_the_worker_that_owns_the_bank(monkeypatch, owner, held_port):
    monkeypatch.setenv(CHANNEL_SECRET_ENV, "s")
    monkeypatch.setattr(plugin, "CHANNELS", [])
    waits = []
    monkeypatch.setattr(plugin, "worker_waits_for_engine_core", lambda: waits.append(1))
    port = held_port()
    plugin.serve_engine(Steering(owner), _config(port))
    assert waits == [1]  # every worker of a served engine puts off a stop signal
    assert len(plugin.CHANNELS) == (1 if owner else 0)
    if owner:
        try:
            asked = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={SECRET_HEADER: "s"})
            with urllib.request.urlopen(asked, timeout=10) as answer:
                assert b'esamp_port_hits_total{rank="0"} 4' in answer.read()
        finally:
            plugin.CHANNELS[0].close()


def test_an_engine_esamp_serve_did_not_start_gets_nothing(monkeypatch):
    monkeypatch.setattr(plugin, "CHANNELS", [])
    monkeypatch.setattr(plugin, "worker_waits_for_engine_core", lambda: pytest.fail("signals replaced"))
    plugin.serve_engine(Steering(True), _config(None))
    assert plugin.CHANNELS == []


def test_registering_twice_runs_the_step_once(monkeypatch):
    from esamp.engines.vllm import hooks

    monkeypatch.setattr(hooks, "_STEPS", [])
    plugin.register()
    plugin.register()  # vLLM may load the general plugins again in a process
    assert hooks._STEPS == [plugin.serve_engine]
