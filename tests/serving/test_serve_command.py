"""``esamp serve``: the vLLM command it assembles (``--dry-run``), and what it refuses, with the reason.
Runs on the dummy preset's config (no weights are read); needs vLLM installed, as the command does."""

from __future__ import annotations

import argparse
import json

import pytest

from esamp.commands.serve import ESAMP_FIELDS, EXTENSION, build, configure
from esamp.errors import ConfigError, ModelNotFoundError

pytestmark = [pytest.mark.vllm]
PRESET = "qwen2.5-0.5b:dummy"  # a config.json only: resolving it is instant


@pytest.fixture(autouse=True)
def _vllm():
    pytest.importorskip("vllm")


def plan(*argv: str):
    p = argparse.ArgumentParser()
    configure(p)
    args, rest = p.parse_known_args(list(argv))
    return build(args, rest)


def option(command: list[str], name: str, many: bool = False):
    found = [command[i + 1] for i, token in enumerate(command) if token == name]
    return found if many else (found[-1] if found else None)


def test_the_plan_carries_esamp_and_passes_everything_else_through():
    p = plan(
        PRESET,
        "--beta",
        "1.2",
        "--mix",
        "unsharpened",
        "--port",
        "9000",
        "--gpu-memory-utilization",
        "0.5",
        "--channel-port",
        "20000",
        "--enable-prefix-caching",
    )
    command = p.command
    assert command[command.index("--port") : command.index("--port") + 5] == [
        "--port",
        "9000",
        "--gpu-memory-utilization",
        "0.5",
        "--enable-prefix-caching",
    ]  # unchanged, in order
    extra = json.loads(option(command, "--additional-config"))
    assert extra["esamp"]["beta"] == 1.2 and extra["esamp"]["mix"] == "unsharpened"
    assert (extra["esamp"]["source_layer"], extra["esamp"]["target_layer"]) == (0, 23)  # taps resolved: 24 layers
    assert extra["esamp_server"] == {"records_requested": True, "host": "127.0.0.1", "port": 20000}
    assert json.loads(option(command, "--hf-overrides")) == {"architectures": ["EsampQwen2ForCausalLM"]}
    assert option(command, "--worker-extension-cls") == EXTENSION
    assert option(command, "--middleware") == "esamp.serving.middleware.EsampMiddleware"
    assert option(command, "--max-num-seqs") == str(extra["esamp"]["slots"]) == "64"
    assert option(command, "--served-model-name") == PRESET
    assert option(command, "--load-format") == "dummy" and "--skip-tokenizer-init" in command
    assert p.env["ESAMP_SERVE"] == "1"
    assert option(command, "--host") == "127.0.0.1"  # this machine only, unless the operator says so
    secret = p.env["ESAMP_CHANNEL_SECRET"]
    assert len(secret) == 32 and secret not in p.shell() and secret not in " ".join(command)  # never printed
    assert plan(PRESET).env["ESAMP_CHANNEL_SECRET"] != secret  # per launch
    generation = json.loads(option(command, "--override-generation-config"))
    assert generation == {"repetition_penalty": 1.0, "temperature": 0.8, "top_p": 0.95, "min_p": 0.1}
    assert "ESAMP_SERVE=1" in p.shell() and "--middleware" in p.shell()
    # the engine's time to stop; open requests end at once on a stop signal, unless the operator
    # gives --shutdown-timeout, which they may then take to finish
    assert option(command, "--shutdown-timeout") == "5" and "ESAMP_SERVE_DRAIN" not in p.env
    drained = plan(PRESET, "--shutdown-timeout", "30")
    assert option(drained.command, "--shutdown-timeout", many=True) == ["30"]
    assert drained.env["ESAMP_SERVE_DRAIN"] == "30"


def test_the_served_dtype_is_the_library_engines_unless_the_operator_gives_one(monkeypatch):
    """On a CPU without bf16 arithmetic a served engine loads float32, as the library engine does
    (``launch.default_dtype``); an operator's ``--dtype`` is passed once, unchanged."""
    from esamp.engines.vllm import launch

    monkeypatch.setattr(launch, "cpu_bf16", lambda cpuinfo=None: False)
    monkeypatch.setattr("esamp.platform.devices.cuda_available", lambda: False)
    assert option(plan(PRESET).command, "--dtype") == "float32"
    assert option(plan(PRESET, "--dtype", "bfloat16").command, "--dtype", many=True) == ["bfloat16"]


def test_every_esamp_setting_has_a_flag():
    p = argparse.ArgumentParser()
    configure(p)
    flags = {o for a in p._actions for o in a.option_strings}
    assert {
        "--slots",
        "--rank",
        "--lr",
        "--optimizer",
        "--source-layer",
        "--target-layer",
        "--distiller-seed",
        "--distiller",
        "--beta",
        "--mix",
        "--no-esamp",
        "--no-train",
        "--train-rows",
    } <= flags
    assert len(ESAMP_FIELDS) == 13


def test_the_shared_distiller_is_an_engine_setting_of_the_server_not_of_a_request():
    """``--distiller shared`` reaches every rank's engine in --additional-config and is said on
    start; a request cannot choose it (it is no vllm_xargs key: one Distiller for every request)."""
    from esamp.core import payload as pl

    p = plan(PRESET, "--distiller", "shared", "--slots", "8")
    extra = json.loads(option(p.command, "--additional-config"))
    assert extra["esamp"]["distiller"] == "shared" and option(p.command, "--max-num-seqs") == "8"
    assert any("one shared Distiller per rank for up to 8 groups" in note for note in p.notes)
    assert json.loads(option(plan(PRESET).command, "--additional-config"))["esamp"]["distiller"] == "bank"
    with pytest.raises(ConfigError) as err:
        pl.decode({"esamp_distiller": "shared"})
    assert "unknown ESamp setting esamp_distiller" in str(err.value)


@pytest.mark.parametrize(
    "argv, slots, seqs",
    [
        ((), 64, 64),
        (("--slots", "16"), 16, 16),
        (("--max-num-seqs", "128"), 128, 128),
        (("--max_num_seqs=96",), 96, 96),  # vLLM's underscore spelling
        (("--slots", "32", "--max-num-seqs", "8"), 32, 8),
    ],
)
def test_never_more_sequences_in_flight_than_distiller_slots(argv, slots, seqs):
    command = plan(PRESET, *argv).command
    assert json.loads(option(command, "--additional-config"))["esamp"]["slots"] == slots
    assert option(command, "--max-num-seqs", many=True) == [str(seqs)]
    assert not any(t.startswith("--max_num_seqs") for t in command)


def test_user_json_options_are_merged_not_replaced():
    command = plan(
        PRESET,
        "--additional-config",
        '{"mine": 1}',
        "--hf-overrides",
        '{"rope_theta": 5}',
        "--override-generation-config",
        '{"temperature": 0.5}',
        "--generation-config",
        "vllm",
    ).command
    assert json.loads(option(command, "--additional-config"))["mine"] == 1
    assert json.loads(option(command, "--hf-overrides")) == {
        "rope_theta": 5,
        "architectures": ["EsampQwen2ForCausalLM"],
    }
    # the user's filter stays; the penalty is neutralised; no esamp defaults over a filter they chose
    assert json.loads(option(command, "--override-generation-config")) == {
        "temperature": 0.5,
        "repetition_penalty": 1.0,
    }
    assert len(option(command, "--additional-config", many=True)) == 1


def test_vllm_neutral_defaults_when_asked():
    command = plan(PRESET, "--generation-config", "vllm").command
    assert json.loads(option(command, "--override-generation-config")) == {"repetition_penalty": 1.0}


@pytest.mark.parametrize(
    "argv, words",
    [
        (("-tp", "0"), ["--tensor-parallel-size 0", "at least 1"]),
        (("--pipeline-parallel-size", "2"), ["--pipeline-parallel-size 2"]),
        (("--speculative-config", "{}"), ["--speculative-config"]),
        (("--headless",), ["--headless", "this machine", "one esamp serve per machine behind a load balancer"]),
        (("--slots", "8", "--max-num-seqs", "16"), ["--max-num-seqs 16", "--slots 8", "raise --slots to 16"]),
        (("--max-num-seqs", "lots"), ["--max-num-seqs='lots'"]),
        (("--override-generation-config", '{"repetition_penalty": 1.05}'), ["repetition_penalty=1.05", "refused"]),
        (("--additional-config", '{"esamp": {}}'), ["--additional-config", "esamp serve's own flags"]),
        (("--additional-config", "[1]"), ["not a JSON object"]),
        (("--additional-config", "{nope"), ["not JSON"]),
        (("--additional-config.mine", "1"), ["one JSON object"]),
        (("--hf-overrides", '{"architectures": ["X"]}'), ["architectures"]),
        (("--worker-extension-cls", "my.Ext"), ["my.Ext", "one worker extension"]),
        (("--beta", "11"), ["--beta=11.0", "<= 10"]),
        (("--source-layer", "40"), ["source layer 40", "24-layer"]),
        (("--model", "other"), ["two models"]),
        (("--data-parallel-size", "2", "--channel-port", "65535"), ["--channel-port=65535"]),
        (("--served-model-name",), ["needs a value"]),
        (("-dp", "two"), ["--data-parallel-size='two'"]),
    ],
)
def test_what_esamp_serve_refuses_says_why_and_what_to_do(argv, words):
    with pytest.raises(ConfigError) as err:
        plan(PRESET, *argv)
    text = err.value.user_text()
    for word in words:
        assert word in text, text
    assert "hint:" in text


def test_an_unknown_model_says_where_it_looked():
    with pytest.raises(ModelNotFoundError):
        plan("no-such-model-anywhere")


def test_tensor_parallel_size_one_is_fine():
    p = plan(PRESET, "-tp", "1")
    assert p.command and "VLLM_USE_V2_MODEL_RUNNER" not in p.env


@pytest.mark.parametrize("argv", [("-tp", "2"), ("--tensor-parallel-size=2",), ("--tensor_parallel_size", "2")])
def test_tensor_parallel_passes_to_vllm_on_the_v1_runner(argv, monkeypatch):
    import os

    from esamp.platform.devices import cuda_available

    for name in ("VLLM_USE_V2_MODEL_RUNNER", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(name, raising=False)
    p = plan(PRESET, *argv)
    assert p.command.count(argv[0]) == 1  # passed through to vLLM
    assert p.env["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # ESamp's MRV2 adapter refuses tensor parallelism
    if not cuda_available():  # unpinned CPU workers: each its share of the cores
        assert p.env["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() // 2))
    assert any("worker 0 of each engine owns the Distiller" in note for note in p.notes)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # the operator's choice stands (MRV2 then says why not)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in plan(PRESET, *argv).env


def test_the_cli_prints_the_plan_and_exits_2_on_a_bad_flag(capsys):
    from esamp.commands.cli import main

    assert main(["serve", PRESET, "--dry-run", "--port", "9123"]) == 0
    out = capsys.readouterr().out
    assert "ESAMP_SERVE=1" in out and "--port 9123" in out and "--max-num-seqs 64" in out
    assert main(["serve", PRESET, "--dry-run", "--slots", "0"]) == 2
    assert "--slots" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "hi", "--port", "1"])  # other commands still refuse unknown flags
    assert exit_.value.code == 2


def test_the_host_is_this_machine_unless_given_and_an_open_host_without_a_key_is_warned(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert option(plan(PRESET, "--host", "::1").command, "--host", many=True) == ["::1"]
    assert "--host" not in plan(PRESET, "--uds", "/tmp/esamp.sock").command
    wide = plan(PRESET, "--host", "0.0.0.0")
    assert option(wide.command, "--host", many=True) == ["0.0.0.0"]
    assert any("without --api-key" in n for n in wide.notes)
    keyed = plan(PRESET, "--host", "0.0.0.0", "--api-key", "k")
    assert not any("without --api-key" in n for n in keyed.notes)
    assert any("/health, /ping, /metrics and /esamp/metrics" in n for n in keyed.notes)


def test_the_dry_run_line_makes_its_own_secret():
    import subprocess

    line = plan(PRESET).shell()
    assert 'ESAMP_CHANNEL_SECRET="$(python3 -c' in line
    made = subprocess.run(
        ["bash", "-c", line.split(" ESAMP_SERVE=")[0] + " bash -c 'echo \"$ESAMP_CHANNEL_SECRET\"'"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert len(made) == 32 and int(made, 16) >= 0


def test_the_plan_holds_the_channel_ports_it_picked_and_lets_them_pass_to_vllm():
    """esamp serve picks the side channels' ports and holds them (esamp.serving.channel.hold_ports)
    through its exec into vLLM's server, until the ranks bind them; a --channel-port given is the
    operator's and is not held."""
    import os
    import socket
    import sys

    p = plan(PRESET, "--data-parallel-size", "2")
    extra = json.loads(option(p.command, "--additional-config"))
    assert p.held is not None and extra["esamp_server"]["port"] == p.held.base
    if sys.platform.startswith("linux"):
        assert [s.getsockname()[1] for s in p.held.sockets] == [p.held.base, p.held.base + 1]
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", p.held.base + 1))
        p.held.keep_across_exec()
        assert all(os.get_inheritable(s.fileno()) for s in p.held.sockets)
    p.held.close()
    assert plan(PRESET, "--channel-port", "20000").held is None


def test_a_busy_or_privileged_port_is_refused_before_anything_loads(monkeypatch):
    import errno
    import socket

    from esamp.commands.serve import check_listen

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ConfigError) as err:
            check_listen("127.0.0.1", port)
        assert f"port {port}" in err.value.message and "in use" in err.value.message and "--port" in err.value.hint
        with pytest.raises(ConfigError):
            check_listen("0.0.0.0", port)  # every interface includes the busy one
    with pytest.raises(ConfigError) as err:
        check_listen("127.0.0.1", 70000)
    assert "1 to 65535" in err.value.message
    with pytest.raises(ConfigError) as err:
        check_listen("203.0.113.7", 8123)  # TEST-NET-3: not this machine
    assert "not an address of this machine" in err.value.message
    with pytest.raises(ConfigError) as err:
        check_listen("no-such-host.invalid", 8123)
    assert "--host" in err.value.hint

    def refuse(self, address):  # as for a user who is not root, on port 80
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket.socket, "bind", refuse)
    with pytest.raises(ConfigError) as err:
        check_listen("127.0.0.1", 80)
    assert "privileged" in err.value.message and "1024" in err.value.hint


def test_esamp_serve_on_a_busy_port_exits_2_at_once(tmp_path):
    """The port is tried before the model is even looked up (a model that does not exist is not
    reported: the port is), so the answer takes no model load."""
    import os
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        t0 = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "esamp", "serve", "no-such-model", "--port", str(port)],
            capture_output=True,
            text=True,
            cwd=root,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(root)},
        )
    assert done.returncode == 2, done.stderr
    assert f"port {port} on 127.0.0.1 is in use" in done.stderr and "hint:" in done.stderr
    assert "Traceback" not in done.stderr and time.monotonic() - t0 < 60


def test_keys_and_tokens_go_in_the_environment_never_on_a_command_line(capsys, monkeypatch):
    """vLLM's command line is readable by every user of the machine (ps, /proc/PID/cmdline): the API
    keys and the HF token reach vLLM in the environment, and the printed line (the log, --dry-run)
    shows them as ***."""
    from esamp.commands.cli import main
    from esamp.serving.middleware import KEYS_ENV

    monkeypatch.setenv("VLLM_API_KEY", "exported-earlier")
    keyed = plan(PRESET, "--api-key", "k-one", "k-two", "--port", "9123", "--hf-token", "hf-secret")
    assert not {"--api-key", "k-one", "k-two", "--hf-token", "hf-secret"} & set(keyed.command)
    assert json.loads(keyed.env[KEYS_ENV]) == ["k-one", "k-two"] and keyed.env["HF_TOKEN"] == "hf-secret"
    assert keyed.env["VLLM_API_KEY"] == ""  # vLLM's own check takes one key: the middleware checks both
    shell = keyed.shell()
    assert not any(secret in shell for secret in ("k-one", "k-two", "hf-secret", "exported-earlier"))
    assert "--port 9123" in shell and "HF_TOKEN=***" in shell
    one = plan(PRESET, "--api-key=only", "--api-key", "last")  # as vLLM reads it: the last --api-key
    assert json.loads(one.env[KEYS_ENV]) == ["last"] and one.env["VLLM_API_KEY"] == "last"
    assert "--hf-token" in plan(PRESET, "--hf-token", "--port", "9123").command  # bare: no secret in it
    assert main(["serve", PRESET, "--dry-run", "--api-key", "k-one"]) == 0
    out = capsys.readouterr().out
    assert "k-one" not in out and "VLLM_API_KEY=***" in out and "put yours back" in out


@pytest.mark.parametrize(
    "given, whole, batched",
    [
        ((), True, ["32768"]),  # the model's context
        (("--max-model-len", "2048"), True, ["4096"]),  # launch.CPU_STEP_TOKENS
        (("--max-model-len", "32k"), False, []),  # vLLM's own reading of "32k": its scheduling too
        (("--max-num-batched-tokens", "1000"), False, ["1000"]),  # the operator's
        (("--enable-chunked-prefill",), False, []),
        (("--no-enable-chunked-prefill",), True, []),  # the operator's own switch, not doubled
    ],
)
def test_on_a_cpu_every_prompt_is_prefilled_whole_unless_the_operator_schedules(given, whole, batched, monkeypatch):
    """A seeded request prefilled in parts stops vLLM's engine core on a CPU (``launch.scheduling``)."""
    import esamp.platform.devices as devices

    monkeypatch.setattr(devices, "cuda_available", lambda: False)
    off = "--no-enable-chunked-prefill"
    command = plan(PRESET, *given).command
    assert command.count(off) == int(whole)
    assert option(command, "--max-num-batched-tokens", many=True) == batched
    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    assert plan(PRESET, *given).command.count(off) == given.count(off)  # a GPU keeps vLLM's scheduling


def test_engine_arguments_as_flags_turn_a_false_switch_off():
    from esamp.engines.vllm.launch import as_flags

    assert as_flags({"model": "m", "enforce_eager": True, "enable_chunked_prefill": False, "x": None, "n": 3}) == [
        "--enforce-eager",
        "--no-enable-chunked-prefill",
        "--n",
        "3",
    ]
