"""``esamp generate``: n samples of one prompt, with or without ESamp, as text or JSON lines.

Ctrl-C stops decoding and still finishes the output: every sample ends with
``finish_reason="abort"`` (a ``done`` event each with ``--json``; the partial samples and the
summary line in text mode), then the command exits with status 130. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from contextlib import contextmanager

from esamp import engines
from esamp.commands.cli import (
    GROUP_ESAMP_FLAGS,
    SAMPLING_FLAGS,
    ProgressPrinter,
    add_engine_flags,
    refuse_server_distiller,
)
from esamp.core.config import EsampConfig, SamplingConfig, add_flags, from_flags
from esamp.engines.base import check_prompt_text
from esamp.errors import EngineError, EsampError
from esamp.events import DoneEvent, ErrorEvent, Event, StepEvent, TokenEvent
from esamp.platform.threads import add_threads_flag, threads_option

HELP = "generate n samples of a prompt with ESamp (or without, --no-esamp)"
JSON_TYPES = ("token", "step", "done", "error")
INTERRUPTED = 130  # the shell's status for a command ended by SIGINT

# The sampling flags, and stop strings (a base model, prompted with --raw, runs on without them).
GENERATE_SAMPLING = (*SAMPLING_FLAGS, "stop")

# 256-colour ramp from cool (expected) to hot (novel), 11 stops for novelty 0.0 .. 1.0.
HEAT_256 = (39, 38, 37, 36, 71, 106, 142, 178, 208, 202, 196)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt (the chat template is applied unless --raw)")
    add_flags(p, SamplingConfig, GENERATE_SAMPLING)
    add_flags(p, EsampConfig, GROUP_ESAMP_FLAGS)
    add_engine_flags(p, server_help="generate on an esamp serve endpoint (http://HOST:PORT) instead of a local engine")
    add_threads_flag(p)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="one JSON event per line on stdout")


def settings_from_args(args) -> tuple[SamplingConfig, EsampConfig]:
    """The group's settings from the flags the user typed; an error names the flag."""
    refuse_server_distiller(args)
    return from_flags(args, SamplingConfig, GENERATE_SAMPLING), from_flags(args, EsampConfig, GROUP_ESAMP_FLAGS)


def use_colour(stream) -> bool:
    return stream.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


def heat(text: str, novelty: float | None) -> str:
    if novelty is None or not text:
        return text
    colour = HEAT_256[min(int(novelty * (len(HEAT_256) - 1) + 0.5), len(HEAT_256) - 1)]
    return f"\x1b[38;5;{colour}m{text}\x1b[0m"


def legend() -> str:
    """One line that says what the token colours mean."""
    ramp = "".join(f"\x1b[38;5;{c}m█\x1b[0m" for c in HEAT_256)
    return f"novelty: expected {ramp} novel"


def run(args) -> int:
    try:
        check_prompt_text(args.prompt)
        sampling, esamp = settings_from_args(args)
        return _generate(args, sampling, esamp, sys.stdout)
    except EsampError as exc:
        if args.json:
            _json_line(sys.stdout, ErrorEvent(message=exc.message, hint=exc.hint, fatal=True))
        raise


def _json_line(out, event: Event) -> None:
    """One event, its newline in the same write: a reader never sees a line without its end, even
    with an unbuffered stdout (PYTHONUNBUFFERED), where print() writes the newline apart."""
    out.write(event.model_dump_json() + "\n")
    out.flush()


def _load(args, esamp: EsampConfig):
    """The engine, or an ``EsampError`` that says which model could not be loaded and why."""
    try:
        if args.server:
            return engines.create_engine("server", model=args.model, esamp=esamp, url=args.server)
        return engines.create_engine(
            args.engine,
            model=args.model,
            esamp=esamp,
            progress=ProgressPrinter(),
            **threads_option(args.engine, args.threads),
        )
    except (EsampError, KeyboardInterrupt):
        raise
    except Exception as exc:  # transformers and vLLM raise many types for a model they cannot read
        name = args.model or "the embedded default model"
        raise EngineError(
            f"could not load {name}: {type(exc).__name__}: {exc}",
            hint="point --model at a complete Hugging Face directory (config.json, tokenizer files and "
            "weights) or a .gguf file; leave --model out for the embedded model",
        ) from None


@contextmanager
def _first_sigint_sets_flag():
    """Inside: the first Ctrl-C only sets ``flag[0]`` (checked between steps, so the output can be
    finished); a second one raises ``KeyboardInterrupt`` as usual."""
    flag = [False]
    try:
        previous = signal.getsignal(signal.SIGINT)

        def handler(signum, frame):
            if flag[0]:
                raise KeyboardInterrupt
            flag[0] = True

        signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: Ctrl-C cannot reach this loop anyway
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


class _TextOutput:
    """Collects the samples' text and the step counters for the human-readable output."""

    def __init__(self, n: int, colour: bool) -> None:
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.finish: dict[int, DoneEvent] = {}
        self.losses: list[float] = []
        self.port_hits = self.tokens = 0
        self.colour = colour

    def add(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.texts[event.sample].append(heat(event.text, event.novelty) if self.colour else event.text)
            self.tokens += 1
        elif isinstance(event, StepEvent):
            self.port_hits += event.port_hits
            if event.loss is not None:
                self.losses.append(event.loss)
        elif isinstance(event, DoneEvent):
            self.finish[event.sample] = event
        elif isinstance(event, ErrorEvent):
            print(f"error: {event.message}", file=sys.stderr)

    def print(self, out, sampling: SamplingConfig, esamp: EsampConfig, seconds: float, interrupted: bool) -> None:
        if self.colour:
            print(legend(), file=out)
        for i, parts in enumerate(self.texts):
            done = self.finish.get(i)
            tail = f"{done.finish_reason}, {done.tokens} tokens" if done else "unfinished"
            print(f"── sample {i + 1}/{sampling.n} ({tail}) ──", file=out)
            print("".join(parts).strip(), file=out)
        steering = esamp.steering
        state = f"ESamp on, β={steering.beta}, mix={steering.mix}" if steering.enabled else "ESamp off"
        loss = f"{sum(self.losses) / len(self.losses):.4f}" if self.losses else "n/a"
        print(
            f"{sampling.n} samples · {self.tokens} tokens in {seconds:.1f} s · "
            f"{self.tokens / max(seconds, 1e-9):.1f} tok/s · mean Distiller loss {loss} · "
            f"port hits {self.port_hits} · {state}" + (" · interrupted" if interrupted else ""),
            file=out,
            flush=True,
        )


def _generate(args, sampling: SamplingConfig, esamp: EsampConfig, out) -> int:
    if not args.json:
        print(
            f"connecting to {args.server} ..."
            if args.server
            else f"loading {args.model or 'the embedded default model'} ...",
            file=sys.stderr,
        )
    engine = _load(args, esamp)
    ready = engine.ready
    if not args.json:
        how = "connected" if ready.engine == "server" else f"loaded in {ready.load_seconds:.1f} s"
        print(f"{ready.engine} engine, {ready.model} on {ready.device} ({how})", file=sys.stderr)
    text = _TextOutput(sampling.n, use_colour(out) and not args.json)

    def emit(events: list[Event]) -> None:
        for event in events:
            if not args.json:
                text.add(event)
            elif event.type in JSON_TYPES:
                _json_line(out, event)

    interrupted = False
    t0 = time.perf_counter()
    try:
        with _first_sigint_sets_flag() as stop:
            group = engine.start(args.prompt, sampling, esamp.steering, chat=not args.raw)
            while engine.has_unfinished():
                if stop[0]:
                    interrupted = True
                    emit(engine.abort(group))  # each sample's pending token, then its done
                    break
                emit(engine.step())
            if not args.json:
                text.print(out, sampling, esamp, time.perf_counter() - t0, interrupted)
    finally:
        engine.close()
    if interrupted:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    return 0
