"""``esamp generate``: n samples of one prompt, with or without ESamp, as text or JSON lines."""

from __future__ import annotations

import argparse
import os
import sys
import time

from esamp.core.config import EsampConfig, SamplingConfig, make_config
from esamp import engines
from esamp.engines import ENGINE_NAMES
from esamp.engines.base import run as run_group
from esamp.errors import EsampError
from esamp.events import DoneEvent, ErrorEvent, StepEvent, TokenEvent

HELP = "generate n samples of a prompt with ESamp (or without, --no-esamp)"
JSON_TYPES = ("token", "step", "done", "error")

# 256-colour ramp from cool (expected) to hot (novel), 11 stops for novelty 0.0 .. 1.0.
HEAT_256 = (39, 38, 37, 36, 71, 106, 142, 178, 208, 202, 196)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt (the chat template is applied unless --raw)")
    p.add_argument("-n", type=int, default=None, help="samples (default 4)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per sample (default 128)")
    p.add_argument("--beta", type=float, default=None, help="ESamp strength, 0..10 (default 0.8)")
    p.add_argument("--mix", choices=("paper", "unsharpened"), default=None,
                   help="paper: (1+β)z/T − βd (default); unsharpened: z/T − βd")
    p.add_argument("--no-esamp", action="store_true", help="plain sampling, no Distiller")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default 0)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--model", default=None,
                   help="HF directory, .gguf file, local HF-cache name or dummy preset "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--engine", choices=ENGINE_NAMES, default="reference",
                   help="reference (transformers, CPU) or vllm; auto = vllm when CUDA and vLLM exist")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="one JSON event per line on stdout")


def _drop_none(**values):
    return {k: v for k, v in values.items() if v is not None}


def settings_from_args(args) -> tuple[SamplingConfig, EsampConfig]:
    sampling = make_config(SamplingConfig, **_drop_none(
        n=args.n, max_tokens=args.max_tokens, seed=args.seed, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p))
    esamp = make_config(EsampConfig, **_drop_none(beta=args.beta, mix=args.mix),
                        enabled=not args.no_esamp)
    return sampling, esamp


def use_colour(stream) -> bool:
    return stream.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


def heat(text: str, novelty: float | None) -> str:
    if novelty is None or not text:
        return text
    colour = HEAT_256[min(int(novelty * (len(HEAT_256) - 1) + 0.5), len(HEAT_256) - 1)]
    return f"\x1b[38;5;{colour}m{text}\x1b[0m"


def run(args) -> int:
    if not args.prompt.strip():
        raise EsampError("the prompt is empty", hint='pass the prompt as text, e.g. esamp generate "Why is the sky blue?"')
    sampling, esamp = settings_from_args(args)
    out = sys.stdout
    try:
        return _generate(args, sampling, esamp, out)
    except EsampError as exc:
        if args.json:
            print(ErrorEvent(message=exc.message, hint=exc.hint, fatal=True).model_dump_json(), file=out)
        raise


def _generate(args, sampling: SamplingConfig, esamp: EsampConfig, out) -> int:
    if not args.json:
        print(f"loading {args.model or 'the embedded default model'} ...", file=sys.stderr)
    engine = engines.create_engine(args.engine, model=args.model, esamp=esamp)
    ready = engine.ready
    if not args.json:
        print(f"{ready.engine} engine, {ready.model} on {ready.device} (loaded in {ready.load_seconds:.1f} s)",
              file=sys.stderr)
    texts: list[list[str]] = [[] for _ in range(sampling.n)]
    finish: dict[int, DoneEvent] = {}
    losses: list[float] = []
    port_hits = tokens = 0
    colour = use_colour(out) and not args.json
    t0 = time.perf_counter()
    try:
        for event in run_group(engine, args.prompt, sampling, esamp, chat=not args.raw):
            if args.json:
                if event.type in JSON_TYPES:
                    print(event.model_dump_json(), file=out, flush=True)
                continue
            if isinstance(event, TokenEvent):
                texts[event.sample].append(heat(event.text, event.novelty) if colour else event.text)
                tokens += 1
            elif isinstance(event, StepEvent):
                port_hits += event.port_hits
                if event.loss is not None:
                    losses.append(event.loss)
            elif isinstance(event, DoneEvent):
                finish[event.sample] = event
            elif isinstance(event, ErrorEvent):
                print(f"error: {event.message}", file=sys.stderr)
    finally:
        engine.close()
    if args.json:
        return 0
    seconds = time.perf_counter() - t0
    for i, parts in enumerate(texts):
        done = finish.get(i)
        tail = f"{done.finish_reason}, {done.tokens} tokens" if done else "unfinished"
        print(f"── sample {i + 1}/{sampling.n} ({tail}) ──", file=out)
        print("".join(parts).strip(), file=out)
    state = f"ESamp on, β={esamp.beta}, mix={esamp.mix}" if esamp.enabled else "ESamp off"
    loss = f"{sum(losses) / len(losses):.4f}" if losses else "n/a"
    print(f"{sampling.n} samples · {tokens} tokens in {seconds:.1f} s · {tokens / max(seconds, 1e-9):.1f} tok/s"
          f" · mean Distiller loss {loss} · port hits {port_hits} · {state}", file=out)
    return 0
