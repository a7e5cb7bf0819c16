"""``esamp``: the command line. Each subcommand lives in its own module.

A subcommand module exposes ``HELP`` (one line), ``configure(parser)`` and ``run(args) -> int``.
Errors a user can act on (``EsampError``) print as ``error: ...`` plus a hint, exit status 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

from esamp.core.config import Filters
from esamp.errors import ConfigError, EsampError
from esamp.platform.threads import prefer_passive_wait

SUBCOMMANDS = {
    "generate": "esamp.commands.generate",
    "bench": "esamp.commands.bench",
    "eval": "esamp.commands.eval",
    "serve": "esamp.commands.serve",
}


# What ``--model`` takes, the same on every command (esamp.engines.models resolves it).
MODEL_SPEC = (
    "a Hugging Face hub id, downloaded once into huggingface_hub's cache "
    "(Qwen/Qwen2.5-7B-Instruct; short names such as Qwen2.5-7B name their organisation's), "
    "an HF model directory, a .gguf file, a packaged model (gemma3-270m) or a random-weight "
    "preset (qwen2.5-7b:dummy)"
)
ENGINE_HELP = (
    "auto (default): the vLLM engine where a CUDA GPU and vLLM are present, else the reference "
    "engine; reference: transformers on the CPU (the oracle); vllm"
)

# Which settings flags a command offers. Each flag is built from its settings field
# (``esamp.core.config.add_flags``), so its spelling, default, range and help are the field's.
FILTER_FLAGS = tuple(Filters.model_fields)  # temperature, top-p, top-k, min-p
SAMPLING_FLAGS = ("n", "max_tokens", "seed", *FILTER_FLAGS)  # a prompt group's sampling
# ESamp on a command that runs one prompt group at a time (generate, the dashboard): steering on
# or off, its strength and mix, and the engine's Distiller (slots, a bank or one shared).
GROUP_ESAMP_FLAGS = ("enabled", "beta", "mix", "slots", "distiller")


def add_model_flag(parser, *, default: str | None = None, dest: str = "model") -> None:
    """``--model``: what it takes is the same on every command. ``default`` says what a command
    loads without it (the embedded model unless the command says otherwise); ``dest`` is for a
    command that also takes the model another way (esamp serve's MODEL)."""
    if default is None:
        from esamp.engines.models import EMBEDDED_NAME

        default = f"the embedded {EMBEDDED_NAME}"
    parser.add_argument("--model", dest=dest, default=None, metavar="MODEL", help=f"{MODEL_SPEC}; default: {default}")


def add_engine_flags(parser, *, server_help: str, unset: bool = False) -> None:
    """``--model``, ``--engine`` and ``--server``, the same on every command that starts an engine.
    ``unset``: ``--engine`` stays None when not given (a settings file may name one); the engine
    is then ``esamp.engines.DEFAULT_ENGINE`` as everywhere."""
    from esamp.engines import DEFAULT_ENGINE, ENGINE_NAMES

    add_model_flag(parser)
    parser.add_argument("--engine", default=None if unset else DEFAULT_ENGINE, choices=ENGINE_NAMES, help=ENGINE_HELP)
    parser.add_argument("--server", default=None, metavar="URL", help=server_help)


def refuse_server_distiller(args) -> None:
    """``--distiller`` with ``--server``: a served engine's Distiller is chosen when the server
    starts, and a client cannot change it; refused rather than silently ignored."""
    if getattr(args, "server", None) and getattr(args, "distiller", None) is not None:
        raise ConfigError(
            f"--distiller {args.distiller} with --server: the server chose its Distiller when it started",
            hint=f"leave --distiller out, or start the server with esamp serve --distiller {args.distiller}",
        )


class ProgressPrinter:
    """An engine start's progress (``LoadingEvent``s) on a terminal stream: one line rewritten in
    place on a terminal; elsewhere (a log) a line per step, and a download's at most every
    ``every`` seconds."""

    def __init__(self, stream=None, every: float = 5.0) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every
        self._last = 0.0

    def __call__(self, event) -> None:
        counting = event.fraction() is not None
        if self.tty:
            self.stream.write("\r\x1b[K" + event.describe() + ("" if counting else "\n"))
        elif not counting or time.monotonic() - self._last >= self.every:
            self._last = time.monotonic()
            self.stream.write(event.describe() + "\n")
        self.stream.flush()


class Parser(argparse.ArgumentParser):
    """argparse with esamp's error form: the reason, then a hint, exit status 2."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n  hint: {self.prog} --help lists every flag and its range\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="esamp",
        description="Exploratory Sampling: n samples that spread over different ideas.",
    )
    from esamp import __version__

    parser.add_argument("--version", action="version", version=f"esamp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}  # name → its parser, so an error shows that command's usage
    for name, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # subcommand not part of this build
            raise
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.configure(p)
        p.set_defaults(_run=module.run)
        parser.commands[name] = p
    return parser


def quiet_vllm_log() -> None:
    """vLLM logs INFO lines to stdout, where esamp's commands print their results (samples, JSON
    events, reports, the bench table): send its log to stderr, warnings and errors only, unless
    the environment says otherwise. Before vLLM is imported; its engine cores inherit it. Not for
    a command that runs vLLM's own program (esamp serve keeps vLLM's server log). FlashInfer, whose
    kernels vLLM loads on a GPU, logs its JIT's INFO lines (which modules it loads or builds) to
    stderr at its own level: the same, warnings and errors only."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("FLASHINFER_LOGGING_LEVEL", "WARNING")


def main(argv: list[str] | None = None) -> int:
    prefer_passive_wait()  # before anything loads torch (see esamp.platform.threads)
    parser = build_parser()
    # A command that passes the options it does not know to another program (esamp serve → vLLM)
    # gets them as ``args.passthrough``; for every other command they are an error, as before.
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "_passthrough", False):
        command = parser.commands.get(args.command, parser)
        command.error("unrecognized arguments: " + " ".join(unknown))
    args.passthrough = unknown
    if not getattr(args, "_passthrough", False):
        quiet_vllm_log()
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except EsampError as exc:
        print(f"error: {exc.user_text()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `esamp generate ... --json | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
