"""Soak: many prompt groups in one reference engine, some aborted mid-decode. Resident memory must
stay flat and every Distiller slot must come back.

    .venv/bin/python benchmarks/soak.py --groups 1000 --out benchmarks/results/soak-cpu.json

Each group is n=2 samples of a few tokens with ESamp on; every ``--abort-every``-th group is
aborted after its first step, and every ``--overlap-every``-th runs beside the next one (two
groups, two slots, decoding in the same steps). At each checkpoint the JSON records resident
memory, free slots, groups the engine still holds and the novelty normaliser's per-group state.
``tests/project/test_soak.py`` runs this script with 200 groups.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["Name a colour.", "Give a word that rhymes with cat.", "Say hello in French.", "Name a fruit."]


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _finish(engine, keys: list[str], abort_first: set[str], n: int) -> list[str]:
    """Step until ``keys`` are done (aborting ``abort_first`` after one step); the problems seen."""
    problems = []
    done: dict[str, list] = {k: [] for k in keys}
    steps = 0
    while engine.has_unfinished():
        events = engine.step()
        steps += 1
        if steps == 1:
            for key in list(abort_first):
                aborted = engine.abort(key)
                if not aborted:  # it had finished within its first step: nothing to abort
                    abort_first.discard(key)
                events += aborted
        for ev in events:
            if ev.type == "done":
                done[ev.group].append(ev)
            elif ev.type == "error":
                problems.append(f"error event: {ev.message}")
    for key, events in done.items():
        reasons = sorted(e.finish_reason for e in events)
        if sorted(e.sample for e in events) != list(range(n)):
            problems.append(f"group {key}: done events for samples {sorted(e.sample for e in events)}")
        if key in abort_first and set(reasons) != {"abort"}:
            problems.append(f"group {key}: aborted but finished {reasons}")
    return problems


def soak(
    groups: int,
    n: int,
    tokens: int,
    abort_every: int,
    overlap_every: int,
    checkpoint: int,
    threads: int | None,
    chat: bool = True,
) -> dict:
    from esamp.core.config import EsampConfig, SamplingConfig
    from esamp.engines.reference import ReferenceEngine

    engine = ReferenceEngine(threads=threads)
    steering = EsampConfig().steering
    checkpoints, problems = [], []
    started = time.perf_counter()
    i = 0
    while i < groups:
        batch = [i, i + 1] if overlap_every and i % overlap_every == overlap_every - 1 and i + 1 < groups else [i]
        keys, abort_first = [], set()
        for g in batch:
            sampling = SamplingConfig(n=n, max_tokens=tokens, seed=g)
            key = engine.start(PROMPTS[g % len(PROMPTS)], sampling, steering, group=f"soak-{g}", chat=chat)
            keys.append(key)
            if abort_every and g % abort_every == abort_every - 1:
                abort_first.add(key)
        problems += _finish(engine, keys, abort_first, n)
        i += len(batch)
        if i % checkpoint < len(batch) or i >= groups:
            checkpoints.append(
                dict(
                    groups=i,
                    seconds=round(time.perf_counter() - started, 1),
                    rss_mb=round(_rss_mb(), 1),
                    free_slots=engine.bank.free_slots,
                    slots=engine.bank.capacity,
                    held_groups=len(engine.groups),
                    normaliser_groups=len(engine.normalizer._stats),
                )
            )
    engine.close()
    warm = next((c for c in checkpoints if c["groups"] >= max(checkpoint, groups // 10)), checkpoints[0])
    last = checkpoints[-1]
    return dict(
        groups=groups,
        n=n,
        tokens=tokens,
        chat=chat,
        abort_every=abort_every,
        overlap_every=overlap_every,
        seconds=round(time.perf_counter() - started, 1),
        rss_growth_mb=round(last["rss_mb"] - warm["rss_mb"], 1),
        rss_from_groups=warm["groups"],
        all_slots_back=all(
            c["free_slots"] == c["slots"] and c["held_groups"] == 0 and c["normaliser_groups"] == 0 for c in checkpoints
        ),
        problems=problems[:20],
        checkpoints=checkpoints,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=1000)
    ap.add_argument("-n", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--abort-every", type=int, default=50)
    ap.add_argument("--overlap-every", type=int, default=7)
    ap.add_argument("--checkpoint", type=int, default=50)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--raw", action="store_true", help="prompts without the chat template (shorter prefill)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = soak(
        args.groups,
        args.n,
        args.tokens,
        args.abort_every,
        args.overlap_every,
        args.checkpoint,
        args.threads,
        chat=not args.raw,
    )
    import torch

    result = {
        "command": "python benchmarks/soak.py " + " ".join(sys.argv[1:]),
        "device": f"CPU ({platform.machine()}), torch threads {torch.get_num_threads()}",
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **result,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(
        json.dumps(
            {
                k: result[k]
                for k in ("groups", "seconds", "rss_growth_mb", "rss_from_groups", "all_slots_back", "problems")
            }
        )
    )


if __name__ == "__main__":
    main()
