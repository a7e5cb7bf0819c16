"""The library engine's client-side CPU cost per engine step, without vLLM: ``esamp bench``'s
ESamp side against its baseline, on this machine's CPU.

What it measures: ``VllmEngine.step`` as ``esamp bench`` drives it (``run_trial``'s loop: start
every prompt, step until done, read every event), with vLLM replaced by a fake whose ``step()``
hands out prebuilt delta outputs (vLLM's own ``RequestOutput``, one new token per request per
step) and whose ``collective_rpc("esamp_drain")`` hands out prebuilt step records in the column
form the ESamp processor sends (``step_records._public`` with ``columns``: groups, samples,
generated, errors, candidates, and every training group's loss). Everything else is the real
code: the engine is a ``VllmEngine`` built without starting vLLM (``object.__new__`` and the
attributes its ``step`` reads), so its admission, ``drain``/``_file``, the record pairing of
``record_streams`` and the events of ``esamp.engines.base`` (detokenizer included, through the
stand-in tokenizer a random-weight model uses) run as in the bench. The fake's own work (building
outputs and records) happens before the clock starts; what vLLM costs this process (its output
processor, the RPC's pickling) is not here, and is the same on both sides.

The ESamp side fetches records every ``--drain-steps`` output batches (the engine's
``DRAIN_STEPS``; its time bounds are lifted, since a fake step takes microseconds, not a GPU's
12 ms); a fetch returns every record up to ``--ahead`` steps past the outputs this process has
read (vLLM's async scheduling runs a step ahead). The baseline side is the same engine class with
``plain=True``: no records, no steering.

It prints the CPU and wall microseconds per engine step (an output batch of every running
request) for each side, each pass, sides alternating (B E E B ...), with the garbage collector's
share; with ``--profile`` a cProfile of one more pass of a side. ``--digest`` prints a hash of
every event (times and rates left out) per side, to check that a change to the bookkeeping leaves
the events as they were. A small VM's speed drifts by ±20% from one second to the next: compare
minima over several passes, or codes run alternately.

    .venv/bin/python benchmarks/client_micro.py                  # 32 prompts x n=8 x 256 tokens, 3 passes a side
    .venv/bin/python benchmarks/client_micro.py --profile 30     # and the top 30 functions of an ESamp pass
    .venv/bin/python benchmarks/client_micro.py --no-tokenizer   # without token text (no decoding)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import io
import json
import pstats
import random
import statistics
import sys
import time


class FakeVllm:
    """Stands for ``LLM.llm_engine``: the prebuilt outputs, one batch a step, and the records."""

    def __init__(self, schedule: list[list], records: list[dict], ahead: int) -> None:
        self.schedule, self.records, self.ahead = schedule, records, ahead
        self.renderer = self
        self.requests: list[str] = []
        self.t = self.sent = 0

    def reset(self) -> None:
        self.t = self.sent = 0
        self.requests = []

    # vLLM's renderer and engine, as VllmEngine calls them
    def render_cmpl(self, prompts: list[dict]) -> list[dict]:
        return prompts

    def add_request(self, rid: str, prompt, params) -> None:
        self.requests.append(rid)

    def has_unfinished_requests(self) -> bool:
        return self.t < len(self.schedule)

    def step(self) -> list:
        out = self.schedule[self.t]
        self.t += 1
        return out

    def abort_request(self, ids) -> None:
        pass

    def collective_rpc(self, method: str, args=()) -> list[dict]:
        assert method == "esamp_drain" and args[2] is True, (method, args)
        ready = min(self.t + self.ahead, len(self.records))
        steps, self.sent = self.records[self.sent : ready], max(self.sent, ready)
        return [dict(steps=steps, pending=0, counters={"steps": ready}, free_slots=64, groups=[], active=True)]


def build(keys: list[str], n: int, tokens: int, vocab: int, seed: int) -> tuple[list[list], list[dict]]:
    """Every engine step's delta outputs (each request's new token) and its step record."""
    from vllm.outputs import CompletionOutput, RequestOutput

    from esamp.engines.vllm.step_records import COLUMNS

    rng = random.Random(seed)
    rows = [(key, s) for key in keys for s in range(n)]
    schedule, records = [], []
    for t in range(tokens):
        last = t == tokens - 1
        schedule.append(
            [
                RequestOutput(
                    request_id=f"{key}/{s}",
                    prompt=None,
                    prompt_token_ids=None,
                    prompt_logprobs=None,
                    outputs=[
                        CompletionOutput(
                            0,
                            "",
                            [rng.randrange(100, vocab - 100)],
                            None,
                            None,
                            finish_reason="length" if last else None,
                        )
                    ],
                    finished=last,
                )
                for key, s in rows
            ]
        )
        cols = (
            [key for key, _ in rows],
            [s for _, s in rows],
            [t] * len(rows),  # tokens each row's request had generated before this step
            [rng.lognormvariate(0.0, 0.3) for _ in rows],
            [rng.randint(1, 6) for _ in rows],
        )
        records.append(
            dict(
                step=1000 + t,
                time=float(t),
                loss={key: rng.uniform(0.5, 2.0) for key in keys},
                columns=dict(zip(COLUMNS, cols)),
            )
        )
    return schedule, records


def make_engine(plain: bool, tokenizer, fake: FakeVllm, context: int):
    """A ``VllmEngine`` on ``fake``: what its ``__init__`` sets, less vLLM's start."""
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm.engine import VllmEngine

    engine = object.__new__(VllmEngine)
    super(VllmEngine, engine).__init__(EsampConfig(slots=64))
    engine.plain = plain
    engine._last_drain, engine._batches_since_drain = 0.0, 0
    engine.drains, engine.drain_seconds = 0, 0.0
    engine._channel, engine._channel_asked = None, True  # records through the fake's RPC
    engine.num_layers, engine.hidden, engine.context = 28, 3584, context
    engine.engine, engine.llm = fake, None
    engine.tokenizer, engine.stop_ids = tokenizer, set()
    engine.by_request, engine.release = {}, []
    engine._admitted, engine.first_token_seconds = {}, []
    engine.counters, engine.free_slots = {}, engine.esamp.slots
    engine.model_name, engine.device_name = "fake", "cpu"
    engine._loaded()
    return engine


def digest_of(events: list) -> str:
    """A hash of the events, less what differs from run to run (wall time, rates)."""
    h = hashlib.sha256()
    for ev in events:
        data = ev.model_dump(exclude={"time", "tokens_per_s"} if ev.type == "step" else None)
        h.update(json.dumps(data, sort_keys=True).encode())
    return h.hexdigest()[:16]


def one_pass(engine, fake: FakeVllm, prompts, keys, sampling, steering, keep: list | None = None, profile=None) -> dict:
    """``run_trial``'s loop (``esamp.commands.bench.trials``) on named groups (``profile``: a
    cProfile to enable for the timed part)."""
    from esamp.commands.bench.gc_pauses import GcPauses, totals
    from esamp.commands.bench.trials import Tally

    fake.reset()
    gc.collect()
    drains0 = engine.drains
    if profile is not None:
        profile.enable()
    gc_clock = GcPauses()
    gc_clock.start()
    c0, t0 = time.process_time(), time.perf_counter()
    for p, key in zip(prompts, keys):
        engine.start(p, sampling, steering, group=key)
    tally, steps = Tally(), 0
    while engine.has_unfinished():
        events = engine.step()
        steps += 1
        if keep is not None:
            keep.extend(events)
        tally.add(events)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    collected = totals(gc_clock.stop())
    if profile is not None:
        profile.disable()
    engine.drain()
    batches = len(fake.schedule)
    assert tally.produced == batches * len(fake.requests), (tally.produced, batches, len(fake.requests))
    return dict(
        cpu_us=1e6 * cpu / batches,
        wall_us=1e6 * wall / batches,
        gc_us=1e6 * collected["seconds"] / batches,
        collections=collected["collections"],
        calls=steps,
        port_hits=tally.port_hits,
        drains=engine.drains - drains0,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=152064, help="sampled ids below this (Qwen2.5 7B's)")
    ap.add_argument("--drain-steps", type=int, default=None, help="output batches per record fetch (DRAIN_STEPS)")
    ap.add_argument("--ahead", type=int, default=1, help="records this many steps past the outputs read")
    ap.add_argument("--passes", type=int, default=3, help="timed passes per side, the sides alternating")
    ap.add_argument("--sides", default="baseline,esamp", help="the sides to time (for py-spy: esamp alone)")
    ap.add_argument("--no-tokenizer", action="store_true", help="no token text (skips the stand-in tokenizer)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile an ESamp pass: top N functions")
    ap.add_argument(
        "--profile-sides", default="esamp", help="the sides --profile profiles (comma-separated: esamp,baseline)"
    )
    ap.add_argument("--digest", action="store_true", help="print a hash of each side's events")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from esamp.commands.bench.workloads import PRESETS, prompts as make_prompts
    from esamp.core.config import SamplingConfig, Steering
    from esamp.engines.vllm import engine as engine_mod

    if args.drain_steps is not None:
        engine_mod.DRAIN_STEPS = args.drain_steps
    engine_mod.DRAIN_MIN_SECONDS, engine_mod.DRAIN_MAX_SECONDS = 0.0, float("inf")  # by batches only
    tokenizer = None
    if not args.no_tokenizer:
        from esamp.engines.models import stand_in_tokenizer

        tokenizer = stand_in_tokenizer()
    P, n, L = args.prompts, args.n, args.tokens
    keys = [f"g{i}" for i in range(P)]
    batch = make_prompts(P, args.prompt_len, args.vocab, seed=P * 1000 + n * 10 + L)
    sampling = SamplingConfig(n=n, max_tokens=L, ignore_eos=True, **PRESETS["default"]["sampling"])
    steering = Steering(**PRESETS["default"]["steering"])
    schedule, records = build(keys, n, L, args.vocab, seed=1)
    gc.collect()
    gc.freeze()  # the prebuilt outputs and records are no garbage collector's work (vLLM's arrive a step at a time)
    context = args.prompt_len + L + 16
    sides = {
        "baseline": (
            make_engine(True, tokenizer, FakeVllm(schedule, [], 0), context),
            steering.model_copy(update={"enabled": False}),
        ),
        "esamp": (make_engine(False, tokenizer, FakeVllm(schedule, records, args.ahead), context), steering),
    }
    out: dict = dict(workload=f"{P}xn{n}x{L}", drain_steps=engine_mod.DRAIN_STEPS, ahead=args.ahead, passes=[])
    order = [name for name in args.sides.split(",") if name]
    for name in order:  # a warm-up pass each (imports, first allocations)
        engine, st = sides[name]
        events: list = []
        one_pass(engine, engine.engine, batch, keys, sampling, st, keep=events if args.digest else None)
        if args.digest:
            out[f"digest_{name}"] = digest_of(events)
            print(f"{name:>8} events: {len(events)}, digest {out[f'digest_{name}']}")
    for r in range(args.passes):
        for name in order if r % 2 == 0 else order[::-1]:
            engine, st = sides[name]
            rec = dict(one_pass(engine, engine.engine, batch, keys, sampling, st), side=name, round=r)
            out["passes"].append(rec)
            print(
                f"  pass {r} {name:>8}: {rec['cpu_us']:8.1f} µs CPU/step  {rec['wall_us']:8.1f} µs wall/step  "
                f"(GC {rec['gc_us']:6.1f} µs/step in {rec['collections']} collections; "
                f"{rec['calls']} step calls, {rec['drains']} record fetches)"
            )
    for name in order if args.passes else ():
        cpu = [p["cpu_us"] for p in out["passes"] if p["side"] == name]
        out[f"{name}_cpu_us_median"] = round(statistics.median(cpu), 1)
        out[f"{name}_cpu_us_min"] = round(min(cpu), 1)
        median = statistics.median(cpu)
        print(f"{name:>8}: median {median:8.1f}, min {min(cpu):8.1f} µs CPU per engine step ({P * n} rows)")
    if args.passes and {"baseline", "esamp"} <= set(order):
        print(f"   ratio: ESamp/baseline CPU per step {out['esamp_cpu_us_median'] / out['baseline_cpu_us_median']:.3f}")
    for name in args.profile_sides.split(",") if args.profile else ():
        engine, st = sides[name]
        prof = cProfile.Profile()
        one_pass(engine, engine.engine, batch, keys, sampling, st, profile=prof)
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s)
        stats.sort_stats("tottime").print_stats(args.profile)
        stats.sort_stats("cumulative").print_stats(args.profile)
        print(f"--- cProfile of one {name} pass ---\n{s.getvalue()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
