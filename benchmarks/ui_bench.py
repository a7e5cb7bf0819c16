"""How many events per second the dashboard absorbs with 8 panes streaming, and at what CPU cost.

Not a timed test: a measurement to read. The scripted engine (``tests/tui/fake_engine.py``) runs
in the real worker process and emits 8 tokens + 1 step event per step; the app runs headless
(``run_test``), so terminal output is not included — a real terminal costs more.

Modes:
- ``max``: the engine steps as fast as it can (8 × 4,000 tokens); the figure, timed from the first
  batch to the last token on screen, is the UI's ceiling.
- ``paced``: the engine sleeps between steps, to a target token rate (default 400 tok/s, i.e.
  8 samples at 50 tok/s each, a 7B model on a good GPU); the figure is what the UI costs then.
- ``engine`` (``--engine vllm --model qwen2.5-7b:dummy``): a real engine in the dashboard's worker,
  8 samples of one long run, with the real memory sampler (GPU memory over NVML on a GPU). The
  dummy preset reads and writes text through the embedded model's tokenizer. Measured over the
  run's middle ``--seconds``; afterwards every sample's events are checked: token indices without a
  gap, and as many tokens in its pane as its ``done`` event counts (``dropped`` is the sum of the
  differences). ``--svg`` saves a screenshot of the dashboard at the end of the window.

UI CPU is ``process_time`` of the app's own process (UI thread + reader thread), over wall time,
in percent of one core; the worker process is not counted.

    .venv/bin/python benchmarks/ui_bench.py [--seconds 8] [--rate 400] [--json out.json]
    python benchmarks/ui_bench.py --engine vllm --model qwen2.5-7b:dummy --seconds 20 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]


async def measure(seconds: float, delay: float, burst_tokens: int = 4000, size=(200, 50)) -> dict:
    """Paced (delay > 0): steady state over ``seconds``. Max (delay 0): one burst of
    ``burst_tokens`` per pane, timed from the first batch to the last token on screen."""
    import esamp_tui.diversity
    from esamp_tui.app import EsampApp
    from esamp_tui.controller import SessionController

    # Vendi loads a sentence embedder in a UI thread when a run ends; that is not streaming cost.
    esamp_tui.diversity.vendi_available = lambda: False
    from tui.conftest import FixedMemory, fake_options

    counts = {"events": 0, "tokens": 0, "batches": 0}
    seen: dict[int, object] = {}  # the hook can see one message more than once; count each once

    def hook(message) -> None:
        if isinstance(message, SessionController.EventBatch) and id(message) not in seen:
            seen[id(message)] = message
            counts["batches"] += 1
            counts["events"] += len(message.events)
            counts["tokens"] += sum(e.type == "token" for e in message.events)

    paced = delay > 0
    options = fake_options(n=8, max_tokens=30_000 if paced else burst_tokens, engine_options=dict(delay=delay))
    app = EsampApp(options, memory_sampler=FixedMemory())
    async with app.run_test(size=size, message_hook=hook) as pilot:
        screen = app.main_screen
        while not screen.controller.ready:
            await pilot.pause(0.05)
        await pilot.pause(1.0)  # charts drawn once, layout settled
        screen.run_prompt("benchmark")
        if paced:
            while not counts["tokens"]:
                await pilot.pause(0.05)
            await pilot.pause(1.0)  # warm up: panes laid out and streaming
        start = dict(counts)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        if paced:
            await pilot.pause(seconds)
        else:
            expected = 8 * burst_tokens - 2  # the scripted sample 1 stops two tokens early
            while sum(p.token_count for p in screen.results.rows["r1-on"].panes) < expected:
                await pilot.pause(0.02)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        end = dict(counts)
    return {
        "mode": "paced" if paced else "max",
        "step_delay_s": round(delay, 4),
        "seconds": round(wall, 2),
        "events_per_s": round((end["events"] - start["events"]) / wall, 1),
        "tokens_per_s": round((end["tokens"] - start["tokens"]) / wall, 1),
        "batches_per_s": round((end["batches"] - start["batches"]) / wall, 2),
        "ui_cpu_percent_of_one_core": round(100 * cpu / wall, 1),
    }


async def measure_engine(
    engine: str,
    model: str,
    seconds: float,
    n: int = 8,
    size=(200, 50),
    svg: Path | None = None,
    load_timeout: float = 600.0,
) -> dict:
    """The dashboard on a real engine: see the module's ``engine`` mode."""
    import esamp_tui.diversity
    from esamp.core.config import SamplingConfig
    from esamp.events import DoneEvent, TokenEvent
    from esamp.platform.gpu import MemorySampler
    from esamp_tui.app import EsampApp
    from esamp_tui.controller import SessionController
    from esamp_tui.options import Options

    esamp_tui.diversity.vendi_available = lambda: False
    received: dict[tuple[str, int], list[int]] = {}
    done: dict[tuple[str, int], int] = {}
    counts = {"tokens": 0, "batches": 0}
    seen: dict[int, object] = {}  # kept alive, so an id is never reused for another batch

    def hook(message) -> None:
        if isinstance(message, SessionController.EventBatch) and id(message) not in seen:
            seen[id(message)] = message
            counts["batches"] += 1
            for event in message.events:
                if isinstance(event, TokenEvent):
                    counts["tokens"] += 1
                    received.setdefault((event.group, event.sample), []).append(event.index)
                elif isinstance(event, DoneEvent):
                    done[(event.group, event.sample)] = event.tokens

    # The longest run the context allows, so the window sits in its middle.
    options = Options(
        engine=engine, model=model, sampling=SamplingConfig(n=n, max_tokens=4000, ignore_eos=True), log_file=""
    )
    sampler = MemorySampler()
    app = EsampApp(options, memory_sampler=sampler)
    memory = []
    async with app.run_test(size=size, message_hook=hook) as pilot:
        screen = app.main_screen
        t0 = time.perf_counter()
        while not screen.controller.ready:
            if screen.controller.failed is not None:
                raise SystemExit(f"the engine failed: {screen.controller.failed.message}")
            if time.perf_counter() - t0 > load_timeout:
                raise SystemExit("the engine did not start in time")
            await pilot.pause(0.2)
        load_s = time.perf_counter() - t0
        screen.run_prompt("Write a long story about a lighthouse keeper and the sea.")
        while counts["tokens"] < 20 * n:
            await pilot.pause(0.05)
        await pilot.pause(2.0)  # panes laid out, charts drawn, steady decoding
        start = dict(counts)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        await pilot.pause(seconds)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        end = dict(counts)
        if svg is not None:
            svg.write_text(app.export_screenshot())
        sample = screen.charts.memory_sample
        if sample is not None:
            memory = [
                sample.kind,
                sample.device,
                round((sample.used or 0) / 2**30, 2),
                round((sample.total or 0) / 2**30, 2),
            ]
        series = len(screen.charts.memory.points)
        deadline = time.perf_counter() + 600
        while not all(g.finished for g in screen.record.groups.values()) and time.perf_counter() < deadline:
            await pilot.pause(0.2)
        panes = {
            (key, i): pane.token_count for key, row in screen.results.rows.items() for i, pane in enumerate(row.panes)
        }
        info = screen.controller.ready
    gaps = sum(1 for indices in received.values() for a, b in zip(indices, indices[1:]) if b != a + 1)
    dropped = sum(abs(done.get(k, -1) - len(v)) for k, v in received.items()) + gaps
    dropped += sum(abs(panes.get(k, 0) - len(v)) for k, v in received.items())
    return {
        "mode": "engine",
        "engine": info.engine,
        "model": info.model,
        "device": info.device,
        "n": n,
        "engine_load_s": round(load_s, 1),
        "seconds": round(wall, 2),
        "tokens_per_s": round((end["tokens"] - start["tokens"]) / wall, 1),
        "batches_per_s": round((end["batches"] - start["batches"]) / wall, 2),
        "ui_cpu_percent_of_one_core": round(100 * cpu / wall, 1),
        "samples_checked": len(received),
        "tokens_checked": sum(len(v) for v in received.values()),
        "dropped_events": dropped,
        "index_gaps": gaps,
        "memory_last_sample": memory,
        "memory_series_points": series,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rate", type=float, default=400.0, help="paced mode: tokens/s over 8 panes")
    parser.add_argument("--engine", default=None, help="engine mode: a real engine (vllm, reference)")
    parser.add_argument("--model", default=None, help="engine mode: the model (e.g. qwen2.5-7b:dummy)")
    parser.add_argument("--svg", type=Path, default=None, help="engine mode: a screenshot at the end of the window")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    results = []
    runs = (
        [lambda: measure_engine(args.engine, args.model, args.seconds, svg=args.svg)]
        if args.engine
        else [lambda delay=delay: measure(args.seconds, delay) for delay in (0.0, 8 / args.rate)]
    )
    for run in runs:
        result = asyncio.run(run())
        results.append(result)
        print(json.dumps(result))
    meta = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "note": "headless run_test, "
        + (
            f"{args.engine} engine in the real worker process"
            if args.engine
            else "scripted engine in the real worker process; machine shared"
        ),
    }
    try:
        import textual

        meta["textual"] = textual.__version__
    except Exception:
        pass
    if args.engine:
        from esamp.commands.bench import provenance

        meta.update(versions=provenance.versions(), device=provenance.device(), commit=provenance.commit())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
