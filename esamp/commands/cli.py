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

from esamp.errors import EsampError
from esamp.platform.threads import prefer_passive_wait

SUBCOMMANDS = {
    "generate": "esamp.commands.generate",
    "bench": "esamp.commands.bench",
    "eval": "esamp.commands.eval",
    "serve": "esamp.commands.serve",
}


MODEL_HELP = ("a Hugging Face hub id, downloaded once into huggingface_hub's cache "
              "(Qwen/Qwen2.5-7B-Instruct; short names such as Qwen2.5-7B name their organisation's), "
              "an HF model directory, a .gguf file, a packaged model (gemma3-270m) or a random-weight "
              "preset (qwen2.5-7b:dummy); default: the embedded SmolLM2-135M-Instruct")
ENGINE_HELP = ("auto (default): the vLLM engine where a CUDA GPU and vLLM are present, else the reference "
               "engine; reference: transformers on the CPU (the oracle); vllm")


def add_engine_flags(parser, *, server_help: str, unset: bool = False) -> None:
    """``--model``, ``--engine`` and ``--server``, the same on every command that starts an engine.
    ``unset``: ``--engine`` stays None when not given (a settings file may name one); the engine
    is then ``esamp.engines.DEFAULT_ENGINE`` as everywhere."""
    from esamp.engines import DEFAULT_ENGINE, ENGINE_NAMES

    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--engine", default=None if unset else DEFAULT_ENGINE, choices=ENGINE_NAMES, help=ENGINE_HELP)
    parser.add_argument("--server", default=None, metavar="URL", help=server_help)


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
    a command that runs vLLM's own program (esamp serve keeps vLLM's server log)."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


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
