"""The ``esamp bench`` command: options, the sides, the workloads, the report."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from esamp.commands.bench import calibrate, memory, provenance, vllm_log
from esamp.commands.bench.stop import StopSignals
from esamp.commands.bench.trials import run_interleaved, run_trial, size_rounds
from esamp.commands.bench.workloads import (
    CPU_TRIALS,
    CPU_WORKLOADS,
    MAX_LENGTHENINGS,
    MAX_ROUNDS,
    MIN_TRIAL_SECONDS,
    PRESETS,
    SPREAD_TARGET,
    parse_workloads,
    prompts,
    spread,
    workload_name,
)
from esamp.commands.cli import FILTER_FLAGS, add_model_flag
from esamp.core.config import EsampConfig, Filters, SamplingConfig, add_flags, from_flags
from esamp.errors import ConfigError, EngineError, EsampError

HELP = "measure ESamp's throughput against plain vLLM (interleaved trials, JSON result)"
LOGITS = ("flat", "realistic")
DEFAULT_LOGITS = "flat"  # benchmarks/serve_bench.py takes the same default
GPU_MODEL = "qwen2.5-7b:dummy"
SAMPLING_FLAGS = (*FILTER_FLAGS, "seed")  # each workload (PxnNxL) sets n and the tokens
ESAMP_FLAGS = ("beta", "mix", "train_rows", "optimizer", "lr", "rank", "slots", "distiller")
# Unlike generate, the bench draws without per-request seeds unless asked (module docstring).
SAMPLING_DEFAULTS = {"seed": None}


def configure(parser) -> None:
    # Not the embedded model on a GPU: the bench measures vLLM at the size it is used at.
    add_model_flag(parser, default=f"{GPU_MODEL} (random weights) on a GPU, the embedded model on a CPU")
    parser.add_argument(
        "--workloads",
        default=None,
        help="comma-separated workloads: PxL, PxnNxL or a preset (fair) (default: "
        f"{','.join(PRESETS['default']['workloads'])} on a GPU, {','.join(CPU_WORKLOADS)} on a CPU)",
    )
    parser.add_argument(
        "--preset",
        choices=[p for p in PRESETS if p != "default"],
        default=None,
        help="run only a preset's workload with its settings (fair: 8xn16x256, top-p 1.0, min-p 0.05, beta 0.1)",
    )
    parser.add_argument(
        "--logits",
        default=DEFAULT_LOGITS,
        help="comma-separated: flat (dummy weights as they are: the worst case) and/or "
        "realistic (the head rescaled to a real model's candidate count and entropy)",
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=None,
        help=f"timed trials per side and workload (default: 3 on a GPU, {CPU_TRIALS} on a CPU)",
    )
    parser.add_argument(
        "--min-trial-seconds",
        type=float,
        default=MIN_TRIAL_SECONDS,
        help="repeat a short workload within each trial until it lasts about this long, "
        "the same passes on every side, interleaved (0: one pass; default: %(default)s)",
    )
    parser.add_argument(
        "--spread",
        type=float,
        default=None,
        help="trust a workload's ratios when every trial's lies within this share of their median; "
        f"past it, run its trials again with passes twice as long, up to {MAX_LENGTHENINGS} "
        f"times (0: never; default: {SPREAD_TARGET} on a GPU, 0 on a CPU)",
    )
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt length in tokens")
    parser.add_argument("--eager", action="store_true", help="every side without CUDA graphs")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="share of GPU memory for EACH engine (default: 0.42, or 0.28 with --floor)",
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="vLLM workers per engine, every side alike (ESamp: worker 0 owns the Distiller)",
    )
    add_flags(parser, SamplingConfig, SAMPLING_FLAGS, defaults=SAMPLING_DEFAULTS)
    add_flags(parser, EsampConfig, ESAMP_FLAGS)
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time the ESamp engine with ESamp off on every request (the seams' own cost)",
    )
    parser.add_argument(
        "--json",
        dest="json_path",
        default=None,
        help="where to write the JSON result (default: benchmarks/results/bench-MODEL-DATE.json); "
        "vLLM's log goes beside it (NAME.vllm.log)",
    )


def run(args) -> int:
    plan = _plan(args)  # every option checked, memory too, before anything loads
    log = vllm_log.log_path(plan.path)
    try:  # a folder that cannot be written is found now, not after the measurements
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_bytes(b"")
    except OSError as exc:
        raise ConfigError(
            f"--json {plan.path}: cannot write {log} beside it ({exc.strerror or exc})",
            hint="pass --json a path in a folder you can write",
        ) from None
    _say(f"vLLM's log (its warnings and progress, off this terminal): {log}")
    loaded: list = []  # engines started so far, closed here when anything fails
    try:
        with vllm_log.stderr_to(log):
            try:
                return _measure(args, plan, loaded, log)
            except BaseException:
                for eng in loaded:  # inside the redirection: their shutdown messages go to the log
                    try:
                        eng.close()
                    except Exception:
                        pass
                raise
    except EngineError as exc:
        raise EngineError(exc.message, hint=vllm_log.failure_hint(log, exc.hint)) from None
    except Exception as exc:
        if isinstance(exc, EsampError):
            raise
        raise EngineError(
            f"esamp bench stopped: {type(exc).__name__}: {exc}",
            hint=vllm_log.failure_hint(
                log,
                "on a CPU it is usually memory (an engine process killed): try "
                "--model qwen2.5-0.5b:dummy, fewer --workloads, or a smaller "
                "VLLM_CPU_KVCACHE_SPACE",
            ),
        ) from None


def _say(text: str) -> None:
    print(text, flush=True)


@dataclass(frozen=True)
class Plan:
    """What a bench will run, from its options, checked before anything loads."""

    workloads: list
    trials: int
    model: str | None
    logits: list[str]
    sampling: SamplingConfig
    esamp: EsampConfig
    given_filters: dict
    given_beta: float | None
    share: float
    spread: float  # the trust target of a workload's ratios (0: any spread)
    max_seqs: int
    path: Path  # the JSON; vLLM's log goes beside it


def _plan(args) -> Plan:
    from esamp.platform.devices import cuda_available

    gpu = cuda_available()
    workloads = parse_workloads(
        args.preset or args.workloads or ",".join(PRESETS["default"]["workloads"] if gpu else CPU_WORKLOADS)
    )
    trials = args.trials if args.trials is not None else (3 if gpu else CPU_TRIALS)
    model = args.model or (GPU_MODEL if gpu else None)
    logits = [m.strip() for m in args.logits.split(",") if m.strip()]
    bad = [m for m in logits if m not in LOGITS]
    if bad or not logits:
        raise ConfigError(
            f"--logits {args.logits}: unknown mode {', '.join(bad) or '(none)'}",
            hint="use --logits flat, --logits realistic or --logits flat,realistic",
        )
    if args.tensor_parallel_size < 1:
        raise ConfigError(
            f"--tensor-parallel-size={args.tensor_parallel_size}: at least 1 worker per engine",
            hint="e.g. --tensor-parallel-size 2 on a machine with two GPUs",
        )
    if trials < 1:
        raise ConfigError(f"--trials={trials}: at least 1 trial is needed", hint="use --trials 3")
    if not 0 <= args.min_trial_seconds <= 600:
        raise ConfigError(
            f"--min-trial-seconds={args.min_trial_seconds}: a trial's length is 0 to 600 s",
            hint=f"use e.g. {MIN_TRIAL_SECONDS} (0: one pass per trial)",
        )
    if args.spread is not None and not 0 <= args.spread < 1:
        raise ConfigError(
            f"--spread={args.spread}: a share of the median ratio, from 0 (never lengthen) to below 1",
            hint=f"use e.g. {SPREAD_TARGET} (every trial's ratio within ±{SPREAD_TARGET:.0%} of the median)",
        )
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization < 1:
        raise ConfigError(
            f"--gpu-memory-utilization={args.gpu_memory_utilization}: a share of the GPU per engine is between 0 and 1",
            hint="use e.g. 0.42 (two engines) or 0.28 (three, with --floor)",
        )
    path = (
        Path(args.json_path)
        if args.json_path
        else (
            Path("benchmarks/results") / f"bench-{str(model or 'embedded').replace(':', '-').replace('/', '_')}-"
            f"{time.strftime('%Y%m%d-%H%M%S')}.json"
        )
    )
    sampling = from_flags(args, SamplingConfig, SAMPLING_FLAGS, defaults=SAMPLING_DEFAULTS)
    esamp = from_flags(args, EsampConfig, ESAMP_FLAGS)
    given_filters = {f: getattr(sampling, f) for f in Filters.model_fields if getattr(args, f, None) is not None}
    groups = max(p for _, (p, _, _) in workloads)
    if esamp.slots < groups:
        raise ConfigError(
            f"--slots={esamp.slots}: a workload runs {groups} prompt groups at once, one Distiller slot each",
            hint=f"use --slots {groups} or more, or fewer prompts per workload",
        )
    engines = 3 if args.floor else 2
    max_seqs = max(p * n for _, (p, n, _) in workloads)
    share = args.gpu_memory_utilization or (0.28 if args.floor else 0.42)
    memory.check_memory(model, engines, share, rows=max(max_seqs, 16), tensor_parallel=args.tensor_parallel_size)
    spread = args.spread if args.spread is not None else (SPREAD_TARGET if gpu else 0.0)
    return Plan(
        workloads=workloads,
        trials=trials,
        model=model,
        logits=logits,
        sampling=sampling,
        esamp=esamp,
        given_filters=given_filters,
        given_beta=getattr(args, "beta", None),
        share=share,
        spread=spread,
        max_seqs=max_seqs,
        path=path,
    )


def _measure(args, plan: Plan, loaded: list, log: Path) -> int:
    """Start the engines and run the bench (``_bench``), with stderr going to vLLM's log
    (``vllm_log``). Engines started go into ``loaded``."""
    from esamp.commands.bench.worker_extension import BENCH_EXTENSION
    from esamp.engines.vllm.engine import VllmEngine

    model, esamp = plan.model, plan.esamp

    def load(side: str, loads: dict, **kw):
        what = "plain vLLM" if kw.get("plain") else f"vLLM with ESamp, Distiller {esamp.distiller}"
        _say(f"loading the {side} engine ({what})...")
        t0 = time.perf_counter()
        try:
            loaded.append(VllmEngine(**kw))
        except (EsampError, KeyboardInterrupt):
            raise
        except Exception as exc:  # vLLM's own start-up errors (memory, an unsupported model, ...)
            raise EngineError(
                f"vLLM could not start {model or 'the embedded model'}: {type(exc).__name__}: {exc}",
                hint="try --model qwen2.5-0.5b:dummy or a smaller --gpu-memory-utilization",
            ) from None
        loads[side] = round(time.perf_counter() - t0, 1)
        return loaded[-1]

    common = dict(
        model=model,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=plan.share,
        max_num_seqs=max(plan.max_seqs, 16),
        enforce_eager=True if args.eager else None,
        tensor_parallel_size=args.tensor_parallel_size,
        llm_kwargs={"worker_extension_cls": BENCH_EXTENSION},
    )

    def start(loads: dict) -> list[tuple]:
        base = load("baseline", loads, plain=True, **common)
        steer = load("esamp", loads, esamp=esamp, **common)
        sides = [("baseline", base, False), ("esamp", steer, True)]
        if args.floor:
            sides.insert(1, ("floor", load("floor", loads, esamp=esamp, **common), False))
        return sides

    return _bench(args, plan, start, loaded, log)


def _bench(args, plan: Plan, start, loaded: list, log: Path) -> int:
    """Start the sides (``start(loads)``: (side, engine, ESamp on) in trial order, each engine also
    in ``loaded``), run every workload, write the JSON and print the table, and close the engines.

    Stopped by SIGINT or SIGTERM (``stop``) at any point, it writes and prints what was measured
    all the same: each workload reached, with the rounds and trials it finished (``WorkloadRun``),
    the workloads not reached listed as not measured. It returns 128 + the signal then (130 for
    SIGINT, as before; 143 for SIGTERM), 0 otherwise."""
    sampling, esamp = plan.sampling, plan.esamp
    loads: dict[str, float] = {}
    sides: list[tuple] = []
    runs: list[WorkloadRun] = []
    calibration: dict = {}
    runners: dict[str, str | None] = {}
    stop = StopSignals().install()
    try:
        try:
            sides = start(loads)
            runners.update(_runners(sides))
            steer = dict((side, eng) for side, eng, _ in sides)["esamp"]
            base = sides[0][1]
            vocab = 32000
            try:
                vocab = int(json.loads((base.resolved.hf_dir() / "config.json").read_text())["vocab_size"])
            except Exception:
                pass
            for mode in plan.logits:
                if mode == "realistic":
                    calibration = _calibrate(base, steer, sides, plan.given_filters, args.prompt_len, vocab, esamp)
                for preset_name, (P, n, L) in plan.workloads:
                    _workload(
                        mode,
                        preset_name,
                        (P, n, L),
                        sides,
                        plan.given_filters,
                        plan.given_beta,
                        sampling,
                        esamp,
                        vocab,
                        args,
                        plan.trials,
                        runs,
                        spread=plan.spread,
                    )
                if mode == "realistic":
                    calibrate.scale_heads(sides, None)  # back to the dummy weights for the next mode
            counters, peaks = _engine_reports(steer, sides, interrupted=False)
        except BaseException as exc:
            # A stop signal, however it surfaced: a KeyboardInterrupt, or an error that it caused
            # (an engine process it ended, a lock it left half taken). Anything else is a failure.
            if not stop.stopped(exc):
                raise
            stop.hold()
            how = "" if isinstance(exc, KeyboardInterrupt) else f"; {type(exc).__name__} on the way out"
            _say(f"interrupted ({stop.name}{how}): writing what was measured")
            ask = dict((side, eng) for side, eng, _ in sides).get("esamp")
            counters, peaks = _engine_reports(ask, sides, interrupted=True) if ask is not None else ({}, {})
        stop.hold()  # the report is written whatever comes now
        interrupted = stop.signum is not None
        rows = [run.row() for run in runs]
        if interrupted:
            rows = _with_unreached(plan, rows)
        steer = dict((side, eng) for side, eng, _ in sides).get("esamp")
        report = dict(
            command=" ".join(["esamp", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"] else " ".join(sys.argv),
            commit=provenance.commit(),
            device=provenance.device(),
            versions=provenance.versions(),
            environment=provenance.environment(),
            model=steer.model_name if steer is not None else plan.model,
            cuda_graphs=not args.eager,
            tensor_parallel_size=args.tensor_parallel_size,
            esamp=esamp.flat(),
            seed=sampling.seed,
            trials=plan.trials,
            prompt_len=args.prompt_len,
            load_seconds=loads,
            # each side's model runner, as its engine reports it: on vLLM 0.25 and later a plain
            # engine runs Model Runner V2 and an ESamp engine the V1 runner (docs/vllm.md)
            runners=runners,
            calibration=calibration,
            peak_memory_bytes=peaks,
            esamp_counters=counters,
            host_ms_per_steady_step=round(counters["replay_host_ms"] / counters["replay_steps"], 4)
            if counters.get("replay_steps")
            else None,
            host_split_per_steady_step=steady_split(counters),
            # of that, the engine thread's CPU time (MRV2's adapter): the rest it waited (the GIL, the OS)
            host_cpu_ms_per_steady_step=round(counters["replay_cpu_ms"] / counters["replay_steps"], 4)
            if counters.get("replay_steps") and counters.get("replay_cpu_ms")
            else None,
            # a replayed step whose batch changed (its plan built), apart from the steady ones
            host_ms_per_rebuild_step=round(counters["rebuild_host_ms"] / counters["rebuild_steps"], 4)
            if counters.get("rebuild_steps")
            else None,
            workloads=rows,
            interrupted=interrupted,
            signal=stop.name if interrupted else None,
            time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        path = plan.path
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")  # a cut write leaves the last whole file
        partial.write_text(json.dumps(report, indent=2))
        os.replace(partial, path)
        _print_table(report)
        _say(f"wrote {path}; vLLM's log: {log}")
        if stop.signum is not None:
            stop.leave_at_once()  # a further signal while the engines close ends the bench at once
        for eng in loaded:
            try:
                eng.close()
            except Exception:
                if stop.signum is None:
                    raise  # (stopped, an engine process the signal ended may fail its shutdown)
        loaded.clear()
        return stop.status
    finally:
        stop.restore()


def steady_split(counters: dict) -> dict[str, float] | None:
    """Where ESamp's host time of a steady step went, in ms a step: the Distiller step, the filter
    and mix, the record, and the rest (the adapter's bookkeeping); None before any steady step."""
    steps = counters.get("replay_steps")
    if not steps or "replay_distill_ms" not in counters:
        return None
    parts = {name: counters[f"replay_{name}_ms"] for name in ("distill", "mix", "records")}
    parts["rest"] = counters["replay_host_ms"] - sum(parts.values())
    return {name: round(ms / steps, 4) for name, ms in parts.items()}


def _runners(sides) -> dict[str, str | None]:
    """Each side's model runner, "V1" or "MRV2" (``EsampWorkerExtension.esamp_info``), None where
    its engine cannot say."""
    out: dict[str, str | None] = {}
    for side, engine, _ in sides:
        try:
            out[side] = engine.info().get("runner")
        except Exception:  # noqa: BLE001 - an engine without the worker extension
            out[side] = None
    return out


def _calibrate(base, steer, sides, given_filters, prompt_len, vocab, esamp) -> dict:
    filt = {**PRESETS["default"]["sampling"], **given_filters}
    factors, cal = calibrate.realistic_head(calibrate.head_sigma(base), filt, steer, esamp.steering, prompt_len, vocab)
    calibrate.scale_heads(sides, factors)
    _say(calibrate.describe(cal))
    return cal


def _workload(
    mode,
    preset_name,
    shape,
    sides,
    given_filters,
    given_beta,
    sampling,
    esamp,
    vocab,
    args,
    trials,
    results: list[WorkloadRun],
    spread: float = 0.0,
) -> None:
    """Measure one workload. Its ``WorkloadRun`` goes into ``results`` before its first pass and
    holds every trial as it ends, so whenever the bench stops, its row (``WorkloadRun.row``) says
    what this workload finished; nothing is left to do when an interrupt comes."""
    P, n, L = shape
    preset = PRESETS[preset_name]
    sampling_kw = dict({**preset["sampling"], **given_filters}, seed=sampling.seed)
    beta = given_beta if given_beta is not None else preset["steering"]["beta"]
    steering = esamp.steering.model_copy(update={"beta": beta})
    off = steering.model_copy(update={"enabled": False})
    name = workload_name(preset_name, shape)
    run = WorkloadRun(mode, preset_name, shape, sampling_kw, beta, [side for side, _, _ in sides], spread)
    results.append(run)
    batch = prompts(P, args.prompt_len, vocab, seed=P * 1000 + n * 10 + L)
    trial_sides = [(side, eng, steering if on else off) for side, eng, on in sides]
    _say(f"  {mode:>9} {name:>18}: warming up")
    warm = [run_trial(eng, batch, n, min(L, 16), sampling_kw, st)["seconds"] for _, eng, st in trial_sides]
    rounds = size_rounds(trial_sides, batch, n, L, sampling_kw, args.min_trial_seconds, warm[0])
    _say(f"  {mode:>9} {name:>18}: {trials} trials of {rounds} pass{'es' if rounds > 1 else ''} per side")

    def show(r: dict) -> None:
        ttft = f", first token {r['ttft_ms_median']:.1f} ms" if r.get("ttft_ms_median") is not None else ""
        ttft += f", tail {r['tail_ms_median']:.2f} ms" if r.get("tail_ms_median") is not None else ""
        drains = f", {r['drains']} record fetches {r['drain_share']:.0%} of it" if r.get("drains") else ""
        gc = (
            f", engine gc {1e3 * r['gc_seconds']:.1f} ms in {r['gc_collections']}"
            f" (longest {1e3 * r['gc_longest_s']:.1f})"
            if r.get("gc_collections")
            else ""
        )
        # (this process's full collections only: its young ones take microseconds)
        full = (
            f", client full gc {1e3 * r['client_gc_longest_s']:.1f} ms longest of {r['client_gc_full']}"
            if r.get("client_gc_full")
            else ""
        )
        _say(
            f"  {mode:>9} {name:>18} trial {r['trial']} {r['side']:>8}: {r['tok_s']:>10.1f} tok/s  "
            f"(client cpu {r['client_cpu_share']:.0%}{ttft}{drains}{gc}{full})"
        )

    while True:
        attempt = run.attempt(rounds)
        run_interleaved(trial_sides, batch, n, L, sampling_kw, trials, rounds, report=show, out=attempt.records)
        attempt.finished = True
        result = run.summarise(attempt)
        if run.settles(result, len(run.attempts) - 1):
            return
        rounds = min(MAX_ROUNDS, 2 * rounds)
        _say(
            f"  {mode:>9} {name:>18}: ratios spread ±{result['spread']:.1%} (target ±{spread:.0%}): "
            f"again with {rounds} passes per trial"
        )


@dataclass(eq=False)  # told apart by identity (``WorkloadRun.row``)
class Attempt:
    """One round of a workload's trials: ``rounds`` passes per trial and side; ``records`` gets
    each trial's record per side as the trial ends (``run_interleaved``'s ``out``)."""

    rounds: int
    records: list[dict] = field(default_factory=list)
    finished: bool = False


class WorkloadRun:
    """One workload's measurements as they stand: its rounds of trials (``attempts``; a round
    whose ratios spread past the target is followed by one with longer passes), each filled as
    its trials end. Only appends and one flag change it, each a single step, so a stop signal
    can land anywhere in the bench without leaving it half updated; ``row`` makes its report row
    from it when the report is written."""

    def __init__(self, mode, preset, shape, sampling_kw, beta, sides: list[str], spread: float) -> None:
        self.mode, self.preset, self.shape = mode, preset, shape
        self.name = workload_name(preset, shape)
        self.sampling_kw, self.beta, self.sides, self.spread = sampling_kw, beta, sides, spread
        self.attempts: list[Attempt] = []

    def attempt(self, rounds: int) -> Attempt:
        """A new round of trials, ``rounds`` passes each."""
        self.attempts.append(Attempt(rounds))
        return self.attempts[-1]

    def finished_trials(self, attempt: Attempt) -> list[dict]:
        """The records of the trials that every side finished (a stop can come between two sides'
        records of one trial)."""
        seen: dict[int, set] = {}
        for r in attempt.records:
            seen.setdefault(r["trial"], set()).add(r["side"])
        done = {t for t, s in seen.items() if s >= set(self.sides)}
        return [r for r in attempt.records if r["trial"] in done]

    def summarise(self, attempt: Attempt) -> dict:
        """The summary of the round's finished trials (at least one)."""
        kept = self.finished_trials(attempt)
        return dict(
            summary(self.mode, self.preset, self.name, self.shape, self.sampling_kw, self.beta, kept),
            rounds=attempt.rounds,
        )

    def settles(self, result: dict, lengthenings: int) -> bool:
        """Whether a finished round ends the workload: its ratios within the target, or its passes
        as long as they may get."""
        return (
            not self.spread
            or result["spread"] <= self.spread
            or lengthenings >= MAX_LENGTHENINGS
            or result["rounds"] >= MAX_ROUNDS
        )

    def row(self) -> dict:
        """The report's row: the round that settled (``complete``); cut, the round in progress
        when it finished a trial on every side, else the last whole round (``complete: false``,
        ``interrupted: true``); ``measured: false`` when no trial finished on every side. The
        rounds before the reported one go under ``earlier``. ``rounds_finished`` counts the
        rounds whose every trial finished, ``trials_finished`` the reported round's trials."""
        whole = [a for a in self.attempts if a.finished]
        current = self.attempts[-1] if self.attempts and not self.attempts[-1].finished else None
        if current is not None and self.finished_trials(current):
            reported, before = current, whole
        elif whole:
            reported, before = whole[-1], whole[:-1]
        else:
            return dict(
                _row_head(self.mode, self.preset, self.shape, self.sampling_kw, self.beta, self.spread),
                measured=False,
                reached=True,
                complete=False,
                interrupted=True,
                rounds_started=len(self.attempts),
                rounds_finished=0,
                trials_finished=0,
            )
        result = self.summarise(reported)
        complete = reported.finished and current is None and self.settles(result, len(before))
        cut = {} if complete else dict(interrupted=True)
        return dict(
            result,
            spread_target=self.spread,
            within_target=not self.spread or result["spread"] <= self.spread,
            earlier=[_attempt(self.summarise(a)) for a in before],
            measured=True,
            complete=complete,
            reported_round=self.attempts.index(reported) + 1,
            rounds_started=len(self.attempts),
            rounds_finished=len(whole),
            trials_finished=len({r["trial"] for r in result["trials"]}),
            **cut,
        )


def _row_head(mode, preset, shape, sampling_kw, beta, spread) -> dict:
    """What every row says of its workload, measured or not."""
    P, n, L = shape
    return dict(
        logits=mode,
        preset=preset,
        workload=workload_name(preset, shape),
        prompts=P,
        n=n,
        tokens=L,
        sampling=sampling_kw,
        beta=beta,
        spread_target=spread,
    )


def _with_unreached(plan: Plan, rows: list[dict]) -> list[dict]:
    """``rows`` (those of the workloads started, in the plan's order) and a row for each workload
    of the plan that a stopped bench never started (``measured: false, reached: false``)."""
    planned = [(mode, preset, shape) for mode in plan.logits for preset, shape in plan.workloads]
    out = list(rows)
    for mode, preset_name, shape in planned[len(rows) :]:
        preset = PRESETS[preset_name]
        sampling_kw = dict({**preset["sampling"], **plan.given_filters}, seed=plan.sampling.seed)
        beta = plan.given_beta if plan.given_beta is not None else preset["steering"]["beta"]
        out.append(
            dict(
                _row_head(mode, preset_name, shape, sampling_kw, beta, plan.spread),
                measured=False,
                reached=False,
                complete=False,
                interrupted=True,
                rounds_started=0,
                rounds_finished=0,
                trials_finished=0,
            )
        )
    return out


def _attempt(result: dict) -> dict:
    """What a report keeps of an attempt whose ratios spread past the target."""
    keys = (
        "rounds",
        "ratio_median",
        "ratio_min",
        "ratio_max",
        "spread",
        "floor_ratio_median",
        "floor_ratio_min",
        "floor_ratio_max",
    )
    return {k: result[k] for k in keys if k in result}


def _engine_reports(steer, sides, interrupted: bool) -> tuple[dict, dict]:
    """(ESamp's counters, each side's peak GPU memory), asked of the engines. When the bench was
    interrupted nothing is asked: a Ctrl-C reaches vLLM's engine processes too (the terminal's
    whole process group), and an engine that still holds the pass's requests or has stopped would
    not answer. The counters are then those of the last fetch, at the end of the last finished
    pass (every pass ends with one), and the peaks are not known."""
    if interrupted:
        return dict(getattr(steer, "counters", None) or {}), {}
    return steer.drain().get("counters", {}), {side: _peak_memory(eng) for side, eng, _ in sides}


def _peak_memory(engine) -> float | None:
    try:
        return engine.engine.collective_rpc("esamp_memory")[0]
    except Exception:
        return None


def _side_medians(trials, key: str) -> dict[str, float]:
    """The baseline's and the ESamp side's median of the trials' ``key``, for the sides that have it."""
    values = {
        side: [r[key] for r in trials if r["side"] == side and r.get(key) is not None] for side in ("baseline", "esamp")
    }
    return {side: statistics.median(v) for side, v in values.items() if v}


def summary(mode, preset, name, shape, sampling_kw, beta, trials) -> dict:
    P, n, L = shape
    by = {side: [r["tok_s"] for r in trials if r["side"] == side] for side in ("baseline", "esamp", "floor")}
    per_trial = {side: {r["trial"]: r for r in trials if r["side"] == side} for side in ("baseline", "esamp", "floor")}
    ratios = [per_trial["esamp"][t]["tok_s"] / per_trial["baseline"][t]["tok_s"] for t in sorted(per_trial["esamp"])]
    es_trials = [r for r in trials if r["side"] == "esamp"]
    extra, floor_ratios = {}, []
    if by["floor"]:
        floor_ratios = [
            per_trial["floor"][t]["tok_s"] / per_trial["baseline"][t]["tok_s"] for t in sorted(per_trial["floor"])
        ]
        extra = dict(
            floor_tok_s_median=statistics.median(by["floor"]),
            floor_ratio_median=round(statistics.median(floor_ratios), 4),
            floor_ratio_min=round(min(floor_ratios), 4),
            floor_ratio_max=round(max(floor_ratios), 4),
        )
    ttft = _side_medians(trials, "ttft_ms_median")
    if "baseline" in ttft and "esamp" in ttft:
        b, e = ttft["baseline"], ttft["esamp"]
        extra.update(ttft_ms_baseline=b, ttft_ms_esamp=e, ttft_ratio=round(e / b, 4) if b else None)
    # a pass's tail (the step of its last tokens to its end), per side
    extra.update({f"tail_ms_{side}": round(v, 3) for side, v in _side_medians(trials, "tail_ms_median").items()})
    return dict(
        logits=mode,
        preset=preset,
        workload=name,
        prompts=P,
        n=n,
        tokens=L,
        sampling=sampling_kw,
        beta=beta,
        trials=trials,
        spread=round(max(spread(r) for r in (ratios, floor_ratios) if r), 4),
        baseline_tok_s_median=statistics.median(by["baseline"]),
        esamp_tok_s_median=statistics.median(by["esamp"]),
        ratio_median=round(statistics.median(ratios), 4),
        ratio_min=round(min(ratios), 4),
        ratio_max=round(max(ratios), 4),
        ratio_of_medians=round(statistics.median(by["esamp"]) / statistics.median(by["baseline"]), 4),
        loss_count=[r["loss_count"] for r in es_trials],
        loss_first=[r["loss_first"] for r in es_trials],
        loss_last=[r["loss_last"] for r in es_trials],
        port_hits=[r["port_hits"] for r in es_trials],
        candidates_mean=[r["candidates_mean"] for r in es_trials],
        **extra,
    )


def _spread_cell(r: dict) -> str:
    mark = "*" if r.get("within_target") is False else ""
    return f"±{r['spread']:.1%}{mark}" if "spread" in r else "-"


def _cut_note(r: dict, trials: int | None) -> str:
    """What a cut row holds: which round it reports and how far the cut one got."""
    passes = f"{r['rounds']} pass{'es' if r['rounds'] > 1 else ''} a trial"
    of = f" of {trials}" if trials else ""
    if r["reported_round"] > r["rounds_finished"]:  # the round in progress
        return f"cut in round {r['reported_round']} ({passes}) after {r['trials_finished']}{of} trials"
    whole = f"round {r['reported_round']} ({passes}), whole"
    if r["rounds_started"] > r["rounds_finished"]:
        return f"{whole}; cut in round {r['rounds_started']} before a trial finished on every side"
    return f"{whole}; cut before the next round with longer passes"


def _print_table(report: dict) -> None:
    rows = report["workloads"]
    print()
    print(
        f"{'logits':>9} {'workload':>18} {'baseline tok/s':>15} {'esamp tok/s':>12} {'ratio':>7} "
        f"{'(min..max)':>14} {'spread':>7} {'floor':>7} {'TTFT':>6} {'losses':>7} {'port hits':>10} {'mean |C|':>9}"
    )
    for r in rows:
        if r.get("measured") is False:
            why = "cut before a trial finished on every side" if r.get("reached") else "not reached"
            print(f"{r['logits']:>9} {r['workload']:>18}  not measured ({why})")
            continue
        floor = f"{r['floor_ratio_median']:.3f}" if "floor_ratio_median" in r else "-"
        ttft = f"{r['ttft_ratio']:.2f}" if r.get("ttft_ratio") else "-"
        cut = r.get("complete") is False
        print(
            f"{r['logits']:>9} {r['workload']:>18} {r['baseline_tok_s_median']:>15.1f} "
            f"{r['esamp_tok_s_median']:>12.1f} {r['ratio_median']:>7.3f} "
            f"{r['ratio_min']:>6.3f}..{r['ratio_max']:<6.3f} {_spread_cell(r):>7} {floor:>7} {ttft:>6} "
            f"{r['loss_count'][-1]:>7} "
            f"{r['port_hits'][-1]:>10} {r['candidates_mean'][-1]:>9.1f}" + ("  cut" if cut else "")
        )
        if cut:
            print(f"{'':>28} {_cut_note(r, report.get('trials'))}")
        if "floor_ratio_median" in r:
            print(
                f"{'':>28} floor (ESamp engine, ESamp off): {r['floor_tok_s_median']:.1f} tok/s, ratio "
                f"{r['floor_ratio_median']:.3f} {r['floor_ratio_min']:.3f}..{r['floor_ratio_max']:.3f}"
            )
    wide = [r for r in rows if r.get("within_target") is False]
    if wide:
        settled = [r["workload"] for r in wide if r.get("complete") is not False]
        cut = [r["workload"] for r in wide if r.get("complete") is False]
        why = "; ".join(
            [f"even with the longest passes ({', '.join(settled)})"] * bool(settled)
            + [f"cut before longer passes ({', '.join(cut)})"] * bool(cut)
        )
        print(
            f"* ratios spread past ±{wide[0]['spread_target']:.0%} {why}: read them as a range, "
            "or raise --min-trial-seconds or --trials"
        )
    if report.get("host_ms_per_steady_step") is not None:
        split = report.get("host_split_per_steady_step") or {}
        where = ", ".join(f"{part} {ms}" for part, ms in split.items())
        steady = report["host_ms_per_steady_step"]
        print(f"processor host time per steady step: {steady} ms" + (f" ({where})" if where else ""))
        if report.get("host_cpu_ms_per_steady_step") is not None:
            cpu = report["host_cpu_ms_per_steady_step"]
            print(f"  of it the engine thread's CPU time: {cpu} ms (the rest it waited)")
        if report.get("host_ms_per_rebuild_step") is not None:
            print(f"  a step whose batch changed (its plan built): {report['host_ms_per_rebuild_step']} ms")
    if report.get("interrupted"):
        by = f" by {report['signal']}" if report.get("signal") else ""
        if any(r.get("complete") is False for r in rows):
            print(
                f"(interrupted{by}: every workload is listed; a row marked cut holds the trials that "
                "finished, its ratio their median and range)"
            )
        else:
            print(f"(interrupted{by} after every workload finished)")
    runners = report.get("runners") or {}
    print(
        f"device: {report['device']}; vllm {report['versions']['vllm']}, torch {report['versions']['torch']}"
        + ("; model runner: " + ", ".join(f"{side} {name or '?'}" for side, name in runners.items()) if runners else "")
    )
