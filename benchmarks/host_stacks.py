"""Where each vLLM engine core's host thread spends its time, from py-spy's sampled stacks.

``gpu_suite.sh host`` runs ``esamp bench`` under ``py-spy record --subprocesses --idle --threads
-f raw``: every process's Python stacks, sampled from outside, so the engines run at full speed
(the PyTorch profiler slows the host it measures). This reads that file and prints, for each engine
core (the baseline's and ESamp's, told apart by ESamp's tap model in their stacks), the samples of
the thread that runs vLLM's busy loop while it steps, split by phase (schedule, execute_model,
sample_tokens, update_from_output, ...) and by whether the thread was working or waiting on the
GPU; then ESamp's own functions, inclusive. A side whose busy loop hardly waits for its GPU is
host-bound: its step lasts as long as its host work, and the phases say where that goes.

    python benchmarks/host_stacks.py gpu-out/host-qwen2.5-7b-dummy-stacks.txt.gz [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys

# The busy loop's phases, outermost match first (vLLM 0.20's engine core and GPU runner).
PHASES = (
    ("schedule", "Scheduler.schedule "),
    ("update_from_output", "update_from_output"),
    ("sample_tokens", "sample_tokens"),
    ("execute_model", "execute_model"),
    ("wait_for_output", "Future.result"),
    ("outputs", "_send_engine_outputs"),
    ("engine_core_outputs", "put_nowait"),
)
# Leaf frames of a thread that waits (on the GPU, a lock, a queue or a socket) rather than works.
WAITS = re.compile(
    r"synchronize|wait|\bget \(queue|Condition|select|poll|_recv|acquire|sleep|sched_yield|memory_fence|"
    r"ReadTimeoutWithWarnings|dequeue",
    re.I,
)
STEP = "EngineCore.step"  # step_with_batch_queue, or step without a batch queue
STARTUP = ("_do_compile", "compile_or_warm_up", "warm_up", "capture", "EngineSteering.prepare", "esamp_scale_head")
LOOPS = ("run_busy_loop", "worker_busy_loop")
# ESamp frames that wrap vLLM's own work (the tap model's forward is the model's forward): not ESamp's time
WRAPPERS = ("_TapMixin.forward",)  # the engine core's loop; a worker process's (multiprocessing executor)
ESAMP_FRAME = re.compile(r"\((esamp/[^:]+):\d+\)")


def parse(path: str):
    """(processes from the root down, thread, frames, count) per line of a py-spy raw file."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = _join_commands(stack.split(";"))
            procs = [i for i, fr in enumerate(frames) if fr.startswith("process ")]
            if not procs:
                continue
            at = procs[-1]
            chain = tuple(frames[i].split(":", 1)[0] for i in procs)
            rest = frames[at + 1 :]
            thread = rest[0] if rest and rest[0].startswith("thread ") else ""
            if thread:
                rest = rest[1:]
            yield chain, thread, rest, int(count)


def _join_commands(frames: list[str]) -> list[str]:
    """py-spy writes a process frame as ``process PID:"COMMAND"``; a command line with ``;`` in it
    (multiprocessing's ``-c "...; spawn_main(...)"``) is split with the frames: put it back."""
    out: list[str] = []
    for frame in frames:
        if out and out[-1].startswith("process ") and not out[-1].endswith('"'):
            out[-1] += ";" + frame
        else:
            out.append(frame)
    return out


def summarize(path: str) -> dict:
    """Per engine (an engine core's process with its worker processes), per thread that runs a
    busy loop: its samples by phase, waiting or working, and ESamp's functions."""
    rows = list(parse(path))
    cores = {chain[-1] for chain, _, frames, _ in rows if any("run_busy_loop" in fr for fr in frames)}
    engines = {}
    for core in sorted(cores):
        mine = [(chain, t, frames, c) for chain, t, frames, c in rows if core in chain]
        side = "esamp" if any("_TapMixin" in fr for _, _, frames, _ in mine for fr in frames) else "baseline"
        threads = collections.defaultdict(list)
        for chain, thread, frames, c in mine:
            if any(loop in fr for fr in frames for loop in LOOPS):
                threads[f"{chain[-1]} {thread}".strip()].append((frames, c))
        for name, loop in threads.items():
            engines[f"{side} engine {core}: {name}"] = dict(side=side, **_loop(loop))
    return engines


def _loop(loop: list) -> dict:
    """A busy-loop thread's samples: those inside an engine step (start-up's compiles, warm-ups
    and captures left out) by phase, waiting or working; ESamp's functions in them, inclusive;
    the busiest working leaves; and, apart, what the loop did between steps (requests, utility
    calls) and how long it sat idle."""
    phases: collections.Counter = collections.Counter()
    waiting: collections.Counter = collections.Counter()
    esamp: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    between: collections.Counter = collections.Counter()
    idle = startup = ours = 0
    for frames, c in loop:
        leaf = frames[-1] if frames else ""
        if any(mark in fr for fr in frames for mark in STARTUP):
            startup += c
            continue
        if not any(STEP in fr for fr in frames):
            if WAITS.search(leaf):
                idle += c
            else:
                between[leaf.split(" (", 1)[0]] += c
            continue
        label = next((name for fr in frames for name, key in PHASES if key in fr), "other")
        phases[label] += c
        if WAITS.search(leaf):
            waiting[label] += c
        else:
            leaves[leaf[:110]] += c
        if any(ESAMP_FRAME.search(fr) and not fr.startswith(WRAPPERS) for fr in frames):
            ours += c
        seen = set()
        for fr in frames:  # ESamp's functions, inclusive (each once per sample)
            m = ESAMP_FRAME.search(fr)
            if m:
                name = fr.split(" (", 1)[0]
                if name not in seen:
                    seen.add(name)
                    esamp[f"{name} ({m.group(1)})"] += c
    stepping = sum(phases.values())
    return dict(
        stepping=stepping,
        idle=idle,
        startup=startup,
        between_steps=dict(between.most_common(10)),
        phases={k: [v, waiting[k]] for k, v in phases.most_common()},
        waiting_share=round(sum(waiting.values()) / max(stepping, 1), 4),
        esamp_share=round(ours / max(stepping, 1), 4),
        esamp={k: v for k, v in esamp.most_common(25)},
        working_leaves={k: v for k, v in leaves.most_common(25)},
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stacks", help="py-spy's raw output (.txt or .txt.gz)")
    ap.add_argument("--json", help="also write the summary here")
    args = ap.parse_args()
    try:
        engines = summarize(args.stacks)
    except OSError as exc:
        print(f"host_stacks: cannot read {args.stacks} ({exc}); give the file py-spy wrote with -f raw")
        return 2
    if not engines:
        print("no engine core's busy loop in these stacks (was py-spy started with --subprocesses?)")
        return 1
    for name, e in engines.items():
        step = max(e["stepping"], 1)
        print(
            f"== {name}: {e['stepping']} samples in steps (waiting {100 * e['waiting_share']:.1f}%, in ESamp's "
            f"code {100 * e['esamp_share']:.1f}%), {e['idle']} idle, {sum(e['between_steps'].values())} between "
            f"steps, {e['startup']} starting"
        )
        print(f"{'share':>7} {'waiting':>8}  phase")
        for phase, (n, w) in e["phases"].items():
            print(f"{100 * n / step:>6.1f}% {100 * w / step:>7.1f}%  {phase}")
        if e["esamp"]:
            print("  ESamp's functions (inclusive, share of stepping samples):")
            for fn, n in e["esamp"].items():
                print(f"  {100 * n / step:>6.1f}%  {fn}")
        print("  busiest working leaves:")
        for leaf, n in list(e["working_leaves"].items())[:15]:
            print(f"  {100 * n / step:>6.1f}%  {leaf}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(engines, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
