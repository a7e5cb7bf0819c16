"""Timed passes of a workload, and trials that interleave the sides round by round.

A pass starts every prompt as a group of n samples and runs them to exactly their token budget
(``ignore_eos``); it is timed from the first request to the last token. A trial of ``rounds``
passes per side interleaves the sides pass by pass (A B B A A B ...), so whatever drifts during a
trial (clocks, other processes) falls on every side alike; the trial's rate per side is its
tokens over its seconds, and each trial gives one ESamp/baseline ratio.
"""

from __future__ import annotations

import statistics
import time

from esamp.commands.bench.gc_pauses import GcPauses, totals
from esamp.commands.bench.workloads import rounds_for
from esamp.errors import EngineError


class Tally:
    """What a pass's events add up to: the tokens its samples produced, the Distiller's losses, the
    steered rows (port hits) and their candidate counts. A group that failed raises: it would leave
    the pass short of tokens."""

    def __init__(self) -> None:
        self.produced, self.losses, self.port_hits, self.candidates = 0, [], 0, []

    def add(self, events) -> None:
        for ev in events:
            if ev.type == "done":
                self.produced += ev.tokens
            elif ev.type == "step":
                self.port_hits += ev.port_hits
                if ev.loss is not None:
                    self.losses.append(ev.loss)
                if ev.port_hits:
                    self.candidates.append(ev.candidates)
            elif ev.type == "error":
                raise EngineError(f"a bench pass failed: {ev.message}", hint=ev.hint)


def run_trial(engine, prompts, n: int, tokens: int, sampling_kw: dict, steering, rounds: int = 1) -> dict:
    """Run every prompt as a group of n samples to ``tokens`` tokens, ``rounds`` times back to
    back (each round starts when the last finished); time and count the whole."""
    from esamp.core.config import SamplingConfig

    # every sample runs to its budget: the group's ignore_eos reaches vLLM's requests and the
    # group's stream alike (a stream that stopped at EOS while vLLM decoded on counted short)
    sampling = SamplingConfig(n=n, max_tokens=tokens, ignore_eos=True, **sampling_kw)
    first = getattr(engine, "first_token_seconds", None)
    if first is not None:
        first.clear()
    drains0, drain_s0 = getattr(engine, "drains", 0), getattr(engine, "drain_seconds", 0.0)
    _engine_gc(engine, "start")  # between passes: the engine is idle, no step waits for it
    client_gc = GcPauses()
    client_gc.start()
    c0 = time.process_time()
    t0 = time.perf_counter()
    tally = Tally()
    try:  # (a pass that raises, or a stop, leaves no counter behind in this process)
        for _ in range(rounds):
            for p in prompts:
                engine.start(p, sampling, steering)
            while engine.has_unfinished():
                tally.add(engine.step())
    finally:
        ended = time.perf_counter()
        seconds = ended - t0
        client = time.process_time() - c0
        mine = totals(client_gc.stop())
    # the pass's tail: from the engine step that brought its last tokens to the groups' end (the
    # ESamp engine's last records; ``last_output_at``), None for an engine that does not say
    last = getattr(engine, "last_output_at", None)
    tail = ended - last if last is not None and t0 <= last <= ended else None
    produced, losses, cands = tally.produced, tally.losses, tally.candidates
    # the record fetches within the timed pass (not the closing one below)
    drains, drain_s = getattr(engine, "drains", 0) - drains0, getattr(engine, "drain_seconds", 0.0) - drain_s0
    engine.drain()  # release the groups' slots before the next pass
    collected = totals(_engine_gc(engine, "stop"))
    ttft = list(first) if first else []
    # client_cpu_share near 1: this process (event bookkeeping), not the engine, set the pace
    return dict(
        tokens=produced,
        seconds=round(seconds, 4),
        tok_s=round(produced / max(seconds, 1e-9), 2),
        client_cpu_share=round(client / seconds, 3),
        # the ESamp engine's record fetches: this process waits for each (esamp.engines.vllm.engine)
        drains=drains,
        drain_seconds=round(drain_s, 6),
        drain_share=round(drain_s / max(seconds, 1e-9), 3),
        loss_count=len(losses),
        loss_first=losses[0] if losses else None,
        loss_last=losses[-1] if losses else None,
        port_hits=tally.port_hits,
        candidates_mean=round(sum(cands) / len(cands), 2) if cands else 0.0,
        ttft_ms=[round(1e3 * t, 2) for t in ttft],
        tail_ms=None if tail is None else round(1e3 * tail, 3),
        # the engine process's garbage collections in the pass: each pauses its steps
        gc_collections=collected["collections"],
        gc_seconds=collected["seconds"],
        gc_longest_s=collected["longest_s"],
        # this process's (the same ones where the engine core runs here): each pauses the pass's
        # reading of outputs and records, and its starting of requests
        client_gc_collections=mine["collections"],
        client_gc_full=mine["full"],
        client_gc_seconds=mine["seconds"],
        client_gc_longest_s=mine["longest_s"],
    )


def _engine_gc(engine, action: str) -> dict | None:
    """``esamp_gc`` of the bench's worker extension on the engine's first worker, in that worker's
    process: the engine core's with one worker (or this process when vLLM's engine core runs in
    it), TP rank 0's own under tensor parallelism. None where the engine has no such worker (an
    engine other than vLLM's, or one started without the bench's extension)."""
    workers = getattr(engine, "workers", None)
    if workers is None:
        return None
    try:
        return workers("esamp_gc", action)[0]
    except Exception:  # noqa: BLE001 - a worker without the method: nothing is counted
        return None


def size_rounds(sides, prompts, n: int, tokens: int, sampling_kw: dict, min_seconds: float, warm_seconds: float) -> int:
    """Passes per trial so that a trial lasts at least ``min_seconds`` (``rounds_for``), from one
    untimed full pass on every side: the first side's time sizes the trials, and every side has
    then run the workload once at full length before its first timed pass. A short warm-up pass's
    time scaled up is no estimate of a full pass (its fixed costs, the prefill and a side's
    first-time work, would be scaled too: at 7B, 32xn8x256's 16-token warm-up once took longer
    than a quarter of 24 s, so its one-pass trials lasted 3.5 s where 6 were asked). Only a warm-up
    that alone lasted 4 × ``min_seconds`` skips the full passes (one pass a trial)."""
    if min_seconds <= 0 or warm_seconds >= 4 * min_seconds:
        return 1
    full = [run_trial(engine, prompts, n, tokens, sampling_kw, steering)["seconds"] for _, engine, steering in sides]
    return rounds_for(full[0], min_seconds)


def run_interleaved(
    sides,
    prompts,
    n: int,
    tokens: int,
    sampling_kw: dict,
    trials: int,
    rounds: int,
    report=None,
    out: list[dict] | None = None,
) -> list[dict]:
    """``trials`` trials of ``rounds`` passes per side, the sides interleaved pass by pass.
    ``sides``: (name, engine, steering). ``report(record)`` sees each trial's record per side as
    it completes. Returns one record per trial and side, appended to ``out`` as each trial ends
    (so a caller that is interrupted keeps the trials that finished)."""
    out = [] if out is None else out
    for t in range(trials):
        order = list(sides) if t % 2 == 0 else list(reversed(sides))
        parts: dict[str, list[dict]] = {name: [] for name, _, _ in sides}
        for r in range(rounds):
            for name, engine, steering in order if r % 2 == 0 else list(reversed(order)):
                parts[name].append(run_trial(engine, prompts, n, tokens, sampling_kw, steering))
        for name, _, _ in order:
            record = dict(combine(parts[name]), side=name, trial=t, rounds=rounds)
            out.append(record)
            if report is not None:
                report(record)
    return out


def combine(passes: list[dict]) -> dict:
    """One trial's record from its passes: total tokens over total time, every count summed; the
    record fetches' share is their seconds over the passes' seconds."""
    tokens = sum(p["tokens"] for p in passes)
    seconds = sum(p["seconds"] for p in passes)
    drain_seconds = sum(p.get("drain_seconds", 0.0) for p in passes)
    losses = [p for p in passes if p["loss_count"]]
    cands = [p["candidates_mean"] for p in passes if p["candidates_mean"]]
    ttft = [t for p in passes for t in p["ttft_ms"]]
    tails = [p["tail_ms"] for p in passes if p.get("tail_ms") is not None]
    return dict(
        tokens=tokens,
        seconds=round(seconds, 4),
        tok_s=round(tokens / max(seconds, 1e-9), 2),
        pass_tok_s=[p["tok_s"] for p in passes],
        client_cpu_share=round(statistics.mean(p["client_cpu_share"] for p in passes), 3),
        drains=sum(p.get("drains", 0) for p in passes),
        drain_seconds=round(drain_seconds, 6),
        drain_share=round(drain_seconds / max(seconds, 1e-9), 3),
        loss_count=sum(p["loss_count"] for p in passes),
        loss_first=losses[0]["loss_first"] if losses else None,
        loss_last=losses[-1]["loss_last"] if losses else None,
        port_hits=sum(p["port_hits"] for p in passes),
        candidates_mean=round(statistics.mean(cands), 2) if cands else 0.0,
        ttft_ms_median=round(statistics.median(ttft), 2) if ttft else None,
        tail_ms_median=round(statistics.median(tails), 3) if tails else None,
        tail_share=round(sum(tails) / 1e3 / max(seconds, 1e-9), 4) if tails else None,
        gc_collections=sum(p.get("gc_collections", 0) for p in passes),
        gc_seconds=round(sum(p.get("gc_seconds", 0.0) for p in passes), 6),
        gc_longest_s=max((p.get("gc_longest_s", 0.0) for p in passes), default=0.0),
        client_gc_collections=sum(p.get("client_gc_collections", 0) for p in passes),
        client_gc_full=sum(p.get("client_gc_full", 0) for p in passes),
        client_gc_seconds=round(sum(p.get("client_gc_seconds", 0.0) for p in passes), 6),
        client_gc_longest_s=max((p.get("client_gc_longest_s", 0.0) for p in passes), default=0.0),
    )
