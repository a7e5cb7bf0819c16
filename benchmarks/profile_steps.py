"""What a steady engine step costs on the device, kernel by kernel, for one side of ``esamp bench``.

Builds the baseline or the ESamp engine as ``esamp bench`` does, with vLLM's engine core in this
process so that the PyTorch profiler sees its device work. Runs one warm-up trial, then a full
trial of the workload; ``--steps`` engine steps from the middle of the decode phase are traced
(device activity only, so the host is not slowed down by the tracer). Writes a JSON summary:

- ``step_ms``: wall time of every engine step of the timed trial (host clock);
- ``window``: the traced steps' span on the device, the time some kernel ran (``busy_us``), and
  so the device's idle share, which tells a host-bound engine from a device-bound one;
- ``kernels``: per kernel name, launches and total device time over the traced steps.

``--compare BASE.json ESAMP.json`` prints what ESamp adds per step, kernel by kernel (the
difference of the two summaries). One side per process: vLLM's engine core is not built twice in
one process. CUDA only; it measures, it asserts nothing.

``--engine-process``: vLLM's engine core in a process of its own, as ``esamp bench`` runs it
(with the engine core in this process the client and the engine share one host thread, which
hides what the bench sees: whether a side's engine host runs ahead of its device or waits for
it). The engine's worker is then traced by vLLM's profiler, as under tensor parallelism below, and
the device's idle share in the summary is the one the bench's trials have.

``--tensor-parallel-size N``: the workers are processes of vLLM's own, so vLLM's profiler traces
them (``profiler_config``, ``LLM.start_profile``/``stop_profile``: one trace per rank). The summary
then holds ``ranks``, each rank's window and kernels (NCCL's broadcast and all-reduce among them),
and each rank's ESamp counters (host time of the processor, plan builds, replays), so the cost of
every piece under TP is read per rank: rank 0's Distiller step, the ŷ broadcast, the sharded head
and its gather, and where one rank waits for the other (its device idle).

    python benchmarks/profile_steps.py --side esamp --model qwen2.5-7b:dummy --workload 32xn8x256
    python benchmarks/profile_steps.py --side esamp --model qwen2.5-7b:dummy --workload fair --engine-process
    python benchmarks/profile_steps.py --side esamp --model qwen2.5-7b:dummy --workload fair --tensor-parallel-size 2
    python benchmarks/profile_steps.py --compare out/steps-baseline.json out/steps-esamp.json
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import time


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def step_periods(trace: dict) -> list[dict]:
    """Engine step by engine step, from a trace with vLLM's host annotations (``execute_...``,
    one per ``execute_model``; the traces of vLLM's profiler have them): each device event is
    given to the step whose annotation was open, or last opened, when the host launched it (its
    ``correlation`` with the launching runtime call). Per step: ``period_us`` from its first
    device event to the next step's, ``main_us`` and ``other_us`` (busy time of the stream with
    the most events, and of every other stream), ``gap_us`` (the main stream's wait between this
    step's last event there and the next step's first event: the host was late by that much) and
    ``host_ms`` (the annotation's length). The last step has no period. Empty without annotations.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = sorted(
        (float(e["ts"]), float(e.get("dur", 0)))
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("execute_")
    )
    if not steps:
        return []
    marks = [ts for ts, _ in steps]
    launched = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    device = [e for e in events if e.get("cat") in DEVICE_CATS and e.get("args", {}).get("correlation") in launched]
    if not device:
        return []
    streams = collections.Counter(e.get("tid") for e in device)
    main = streams.most_common(1)[0][0]
    per: list[list[dict]] = [[] for _ in marks]
    for e in device:
        at = launched[e["args"]["correlation"]]
        i = bisect.bisect_right(marks, at) - 1
        if i >= 0:
            per[i].append(e)
    rows = []
    for i, evs in enumerate(per):
        if not evs:
            continue
        spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("tid") == main) for e in evs]
        on_main = [(s, f) for s, f, m in spans if m]
        rows.append(
            dict(
                first=min(s for s, _, _ in spans),
                main_end=max((f for _, f in on_main), default=None),
                main_us=round(_busy(on_main), 1),
                other_us=round(_busy([(s, f) for s, f, m in spans if not m]), 1),
                host_ms=round(steps[i][1] / 1e3, 3),
            )
        )
    for row, nxt in zip(rows, rows[1:] + [None]):
        row["period_us"] = round(nxt["first"] - row["first"], 1) if nxt else None
        end = row.pop("main_end")
        row["gap_us"] = round(max(0.0, nxt["first"] - end), 1) if nxt and end is not None else None
    for row in rows:
        row.pop("first")
    return rows


def idle_gaps(trace: dict, min_us: float = 50.0) -> list[dict]:
    """Where the main stream waits inside steps: every idle stretch of at least ``min_us`` between
    two of its device events, with the events before and after it and, for the one after, when the
    host launched it (``late_us``: launch time minus the stretch's start; positive when the host
    was the one late) and with which runtime call. Grouped by (before, after, call): the count, the
    summed idle and the median lateness."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    launches = {
        e["args"]["correlation"]: (float(e["ts"]), e["name"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    device = sorted(
        (e for e in events if e.get("cat") in DEVICE_CATS and e.get("args", {}).get("correlation") in launches),
        key=lambda e: float(e["ts"]),
    )
    if not device:
        return []
    main = collections.Counter(e.get("tid") for e in device).most_common(1)[0][0]
    on_main = [e for e in device if e.get("tid") == main]
    groups: dict[tuple, list[tuple[float, float]]] = collections.defaultdict(list)
    end, before = None, None
    for e in on_main:
        start = float(e["ts"])
        if end is not None and start - end >= min_us:
            at, call = launches[e["args"]["correlation"]]
            groups[(before["name"][:70], e["name"][:70], call)].append((start - end, at - end))
        if end is None or start + float(e.get("dur", 0)) > end:
            end, before = start + float(e.get("dur", 0)), e
    rows = [
        dict(
            before=b,
            after=a,
            call=c,
            count=len(v),
            idle_us=round(sum(g for g, _ in v), 1),
            late_us_median=round(statistics.median(late for _, late in v), 1),
        )
        for (b, a, c), v in groups.items()
    ]
    return sorted(rows, key=lambda r: -r["idle_us"])


def summarize_trace(trace: dict, steps: int) -> dict:
    """Device time per kernel and the window's busy share, from a Chrome trace of the profiler.
    Per-step figures divide by the steps the trace holds where its host annotations tell
    (``step_periods``: vLLM's profiler starts and stops between steps of its own choosing, so a
    window asked for ``steps`` steps may hold one fewer), else by ``steps``."""
    device = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    if not device:
        return dict(window=None, kernels={})
    periods = step_periods(trace)
    steps = len(periods) or steps
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in device]
    start, end = min(s for s, _ in spans), max(e for _, e in spans)
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in device:
        k = kernels[e["name"][:160]]
        k[0] += 1
        k[1] += float(e.get("dur", 0))
    busy = _busy(spans)
    return dict(
        window=dict(
            steps=steps,
            span_us=round(end - start, 1),
            busy_us=round(busy, 1),
            idle_share=round(1 - busy / max(end - start, 1e-9), 4),
            busy_us_per_step=round(busy / steps, 1),
            span_us_per_step=round((end - start) / steps, 1),
        ),
        kernels={k: [int(v[0]), round(v[1], 1)] for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][1])},
        periods=periods,
        period=_period_medians(periods),
    )


def _period_medians(rows: list[dict]) -> dict | None:
    """The medians of ``step_periods``' columns over the steps that have a period."""
    rows = [r for r in rows if r["period_us"] is not None]
    if not rows:
        return None
    out = {k: round(statistics.median(r[k] for r in rows), 1) for k in ("period_us", "main_us", "other_us", "gap_us")}
    return dict(out, host_ms=round(statistics.median(r["host_ms"] for r in rows), 3))


def _load_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def print_gaps(paths: list[str], top: int = 12) -> int:
    """``idle_gaps`` of each trace: the main stream's longest waits and who launched late."""
    for path in paths:
        try:
            rows = idle_gaps(_load_trace(path))
        except (OSError, ValueError) as exc:
            print(f"--gaps {path}: not a readable trace ({exc}); give the .json or .json.gz a profiler wrote")
            return 2
        print(f"== {os.path.basename(path)}: main-stream waits of 50 us or more, longest total first")
        print(f"{'idle us':>10} {'count':>6} {'late us':>8}  before -> after (launched by)")
        for r in rows[:top]:
            where = f"{r['before']} -> {r['after']} ({r['call']})"
            print(f"{r['idle_us']:>10.1f} {r['count']:>6} {r['late_us_median']:>8.1f}  {where}")
    return 0


def print_periods(paths: list[str]) -> int:
    for path in paths:
        try:
            rows = step_periods(_load_trace(path))
        except (OSError, ValueError) as exc:  # no such file, or not a trace (JSON, gzipped or not)
            print(f"--periods {path}: not a readable trace ({exc}); give the .json or .json.gz a profiler wrote")
            return 2
        print(f"== {os.path.basename(path)}: {len(rows)} steps; medians {_period_medians(rows)}")
        print(f"{'period us':>10} {'main us':>9} {'other us':>9} {'gap us':>8} {'host ms':>8}")
        for r in rows:
            period = "-" if r["period_us"] is None else f"{r['period_us']:.1f}"
            gap = "-" if r["gap_us"] is None else f"{r['gap_us']:.1f}"
            print(f"{period:>10} {r['main_us']:>9.1f} {r['other_us']:>9.1f} {gap:>8} {r['host_ms']:>8.3f}")
    return 0


def compare(base_path: str, esamp_path: str, top: int, out: str | None = None) -> int:
    """Print what ESamp adds per step; with ``out``, also write it as JSON (``added_kernel_ms_per_step``,
    ``added_launches_per_step`` and the kernels, per rank under tensor parallelism)."""
    base, esamp = (json.loads(open(p).read()) for p in (base_path, esamp_path))
    if base.get("ranks") and esamp.get("ranks"):  # tensor parallel: rank by rank
        added = []
        for rank, (b, e) in enumerate(zip(base["ranks"], esamp["ranks"])):
            print(f"\n== rank {rank}")
            added.append(_compare(dict(base, **b), dict(esamp, **e), top))
        result = dict(added[0], ranks=added)
    else:
        result = _compare(base, esamp, top)
    if out:
        with open(out, "w") as f:
            json.dump(dict(result, base=base_path, esamp=esamp_path), f, indent=1)
    return 0


def _compare(base: dict, esamp: dict, top: int) -> dict:
    for side in (base, esamp):
        w = side["window"] or {}
        print(
            f"{side['side']:>8}: step median {side['step_ms_median']:.3f} ms (steady), "
            f"device busy {w.get('busy_us_per_step', 0) / 1e3:.3f} ms/step, "
            f"idle {100 * w.get('idle_share', 0):.1f}% of the traced window"
        )
        if side.get("period"):
            p = side["period"]
            print(
                f"{'':>8}  per traced step (medians): period {p['period_us'] / 1e3:.3f} ms, main stream busy "
                f"{p['main_us'] / 1e3:.3f} ms, other streams {p['other_us'] / 1e3:.3f} ms, main stream waiting for "
                f"the host {p['gap_us'] / 1e3:.3f} ms, host execute_model {p['host_ms']:.3f} ms"
            )
    nb, ne = base["window"]["steps"], esamp["window"]["steps"]
    names = set(base["kernels"]) | set(esamp["kernels"])
    rows = []
    for name in names:
        cb, tb = base["kernels"].get(name, [0, 0.0])
        ce, te = esamp["kernels"].get(name, [0, 0.0])
        rows.append((te / ne - tb / nb, ce / ne - cb / nb, name))
    rows.sort(key=lambda r: -abs(r[0]))
    print(
        f"\nper step, ESamp minus baseline: {sum(r[0] for r in rows) / 1e3:+.3f} ms of kernel time, "
        f"{sum(r[1] for r in rows):+.1f} launches"
    )
    print(f"{'Δ us/step':>10} {'Δ launches':>10}  kernel")
    for dt, dc, name in rows[:top]:
        print(f"{dt:>10.1f} {dc:>10.1f}  {name[:110]}")
    return dict(
        added_kernel_ms_per_step=round(sum(r[0] for r in rows) / 1e3, 4),
        added_launches_per_step=round(sum(r[1] for r in rows), 1),
        steps_traced={"baseline": nb, "esamp": ne},
        periods={side["side"]: side.get("period") for side in (base, esamp)},
        kernels=[dict(name=name, us_per_step=round(dt, 2), launches_per_step=round(dc, 2)) for dt, dc, name in rows],
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-7b:dummy")
    ap.add_argument("--workload", default="32xn8x256")
    ap.add_argument(
        "--side",
        choices=("baseline", "floor", "esamp"),
        default="esamp",
        help="floor: the ESamp engine with ESamp off on every request",
    )
    ap.add_argument("--steps", type=int, default=8, help="engine steps to trace")
    ap.add_argument(
        "--skip",
        type=int,
        default=0,
        help="engine steps of the timed trial before tracing (default: a third of its tokens)",
    )
    ap.add_argument("--out", default=".")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument(
        "--seed",
        type=int,
        default=None,
        help="per-request sampling seeds, as esamp bench --seed (the committed profiles used 0)",
    )
    ap.add_argument(
        "--logits",
        choices=("flat", "realistic"),
        default="flat",
        help="realistic: the head rescaled as esamp bench --logits realistic (simulated profile)",
    )
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="workers per engine; above 1 each rank is traced by vLLM's profiler",
    )
    ap.add_argument(
        "--engine-process",
        action="store_true",
        help="vLLM's engine core in a process of its own, as esamp bench runs it (traced by vLLM's profiler)",
    )
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="the engines' max_num_seqs (default: the workload's rows, at least 16; esamp bench sizes its engines "
        "for its largest workload, e.g. 256 when 32xn8x256 runs beside fair)",
    )
    ap.add_argument("--compare", nargs=2, metavar=("BASE", "ESAMP"))
    ap.add_argument("--compare-json", metavar="PATH", help="with --compare: also write what ESamp adds as JSON")
    ap.add_argument(
        "--periods", nargs="+", metavar="TRACE", help="print step_periods of traces (.json or .json.gz), step by step"
    )
    ap.add_argument(
        "--gaps", nargs="+", metavar="TRACE", help="print where the main stream of traces waits inside steps, and why"
    )
    args = ap.parse_args()
    # vLLM's engine core in this process unless --engine-process (read when the engine starts; set
    # here, not at import, so that a test importing this file's readers changes nothing)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.compare:
        return compare(*args.compare, args.top, args.compare_json)
    if args.periods:
        return print_periods(args.periods)
    if args.gaps:
        return print_gaps(args.gaps)
    if args.engine_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # read when the engine starts, below

    import torch
    from torch.profiler import ProfilerActivity, profile

    from esamp.commands.bench import workloads
    from esamp.commands.bench.trials import run_trial
    from esamp.commands.bench.worker_extension import BENCH_EXTENSION
    from esamp.commands.bench.workloads import parse_workload
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm.engine import VllmEngine

    preset = workloads.PRESETS.get(args.workload, {}) if args.workload != "default" else {}
    P, n, L = parse_workload(preset["workloads"][0] if preset else args.workload)
    sampling_kw = dict(
        dict(temperature=0.8, top_p=0.95, min_p=0.1, top_k=0), **preset.get("sampling", {}), seed=args.seed
    )
    esamp = EsampConfig()
    es = esamp.steering.model_copy(update={"enabled": args.side == "esamp", **preset.get("steering", {})})
    tp = args.tensor_parallel_size
    by_vllm = tp > 1 or args.engine_process  # the workers are in other processes: vLLM's profiler traces them
    llm_kwargs = {"worker_extension_cls": BENCH_EXTENSION}
    trace_dir = os.path.abspath(os.path.join(args.out, f"traces-{args.side}-{args.workload}-tp{tp}"))
    if by_vllm:
        os.makedirs(trace_dir, exist_ok=True)
        for old in glob.glob(os.path.join(trace_dir, "*.json*")):  # an earlier run's: every file here is read
            os.remove(old)
        llm_kwargs["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": trace_dir,
            "torch_profiler_with_stack": False,
        }
    engine = VllmEngine(
        model=args.model,
        esamp=esamp,
        plain=args.side == "baseline",
        max_model_len=2048,
        gpu_memory_utilization=0.42,
        max_num_seqs=args.max_num_seqs or max(16, P * n),
        tensor_parallel_size=tp,
        llm_kwargs=llm_kwargs,
    )
    vocab = int(json.loads((engine.resolved.hf_dir() / "config.json").read_text())["vocab_size"])
    if args.logits == "realistic":
        from esamp.commands.bench.calibrate import REAL_MODEL, calibrate_head, head_sigma
        from esamp.commands.bench.workloads import PRESETS

        # every worker's shard of the head (a tensor-parallel rank answers for its own)
        cal = calibrate_head(head_sigma(engine), REAL_MODEL["default"], PRESETS["default"]["sampling"])
        engine.engine.collective_rpc("esamp_scale_head", args=(cal.pop("factors"),))
    prompts = workloads.prompts(P, 32, vocab, seed=P * 1000 + n * 10 + L)
    run_trial(engine, prompts, n, min(L, 16), sampling_kw, es)

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    skip = args.skip or max(2, L // 3)
    inner = engine.engine.step
    walls: list[float] = []
    state = dict(prof=None, tracing=False)

    def stop_tracing():
        state["tracing"] = False
        if by_vllm:
            engine.llm.stop_profile()
        elif state["prof"] is not None:
            if cuda:
                torch.cuda.synchronize()
            state["prof"].__exit__(None, None, None)

    def traced_step():
        i = len(walls)
        if i == skip:
            state["tracing"] = True
            if by_vllm:
                engine.llm.start_profile(args.side)
            else:
                if cuda:
                    torch.cuda.synchronize()
                state["prof"] = profile(activities=activities)
                state["prof"].__enter__()
        t0 = time.perf_counter()
        out = inner()
        walls.append(time.perf_counter() - t0)
        if i == skip + args.steps - 1:
            stop_tracing()
        return out

    engine.engine.step = traced_step
    result = run_trial(engine, prompts, n, L, sampling_kw, es)
    engine.engine.step = inner
    if state["tracing"]:  # --steps reached past the pass's end (e.g. a whole pass): the trace ends with it
        stop_tracing()
    traced = max(1, min(args.steps, len(walls) - skip))  # the steps traced (a trace without vLLM's marks)
    prof = state["prof"]
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"steps-{args.side}-{args.workload}-{args.logits}")
    summary = dict(
        side=args.side,
        model=args.model,
        workload=args.workload,
        tok_s=result["tok_s"],
        tensor_parallel_size=tp,
        engine_process=by_vllm,
        ttft_ms=result.get("ttft_ms"),
        step_ms=[round(1e3 * w, 3) for w in walls],
        step_ms_median=round(1e3 * statistics.median(walls[skip : skip + 4 * args.steps] or walls), 3),
        counters=engine.drain().get("counters", {}),
        window=None,
        kernels={},
    )
    if by_vllm:
        # Every rank's counters (the processor's host time per rank), then every rank's trace.
        per_rank = (
            []
            if args.side == "baseline"
            else [answer.get("counters", {}) for answer in engine.workers("esamp_drain", [], [], False)]
        )
        ranks = []
        for path in sorted(glob.glob(os.path.join(trace_dir, "*.json*"))):
            trace = _load_trace(path)
            named = re.search(r"(?:tp|rank-)(\d+)", os.path.basename(path))  # vLLM's names: ...tpN... or ...rank-N...
            rank = int(named.group(1)) if named else len(ranks)
            ranks.append(dict(rank=rank, trace=os.path.basename(path), **summarize_trace(trace, traced)))
        ranks.sort(key=lambda r: r["rank"])
        for r in ranks:
            r["counters"] = per_rank[r["rank"]] if r["rank"] < len(per_rank) else {}
        summary["ranks"] = ranks
        if ranks:
            summary.update(window=ranks[0]["window"], kernels=ranks[0]["kernels"])
    if prof is not None:
        trace_path = stem + ".trace.json"
        prof.export_chrome_trace(trace_path)
        with open(trace_path) as f:
            trace = json.load(f)
        summary.update(summarize_trace(trace, traced))
        with open(trace_path, "rb") as f, gzip.open(trace_path + ".gz", "wb") as g:
            g.write(f.read())
        os.remove(trace_path)
    with open(stem + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    w = summary["window"] or {}
    print(
        f"== {args.side} {args.workload} on {args.model}: {result['tok_s']} tok/s, steady step "
        f"{summary['step_ms_median']} ms, device busy {w.get('busy_us_per_step')} us/step, "
        f"idle {w.get('idle_share')}; counters {summary['counters']}",
        flush=True,
    )
    for r in summary.get("ranks") or [dict(rank=0, window=summary["window"], kernels=summary["kernels"])]:
        if by_vllm:
            rw, c = r["window"] or {}, r.get("counters", {})
            print(
                f"-- rank {r['rank']}: device busy {rw.get('busy_us_per_step')} us/step, idle {rw.get('idle_share')}; "
                f"host_ms {c.get('host_ms')}, replay_host_ms {c.get('replay_host_ms')}, replay_steps "
                f"{c.get('replay_steps')}, plan_builds {c.get('plan_builds')}"
            )
        held = (r["window"] or {}).get("steps") or traced  # this rank's trace (vLLM's marks counted)
        if r.get("period"):
            print(f"   per step (medians over {held} traced steps): {r['period']}")
        for name, (count, us) in list(r["kernels"].items())[: args.top]:
            print(f"{us / held:>9.1f} us/step {count / held:>6.1f}x  {name[:100]}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
