"""Do the dashboard's loss chart and the eval's learning plot show the same run the same way?

Runs one problem of an ``esamp eval`` folder again in the dashboard, headless (``esamp-tui``'s
app under Textual's test driver, its engine in the worker process as always), with that group's
prompt, sampling, seed and ESamp settings, and exports the dashboard's record as its export key
does. The eval's record of the group keeps the loss of each Distiller step (``samples.jsonl``,
``loss``); the dashboard's ``metrics.jsonl`` keeps the loss of each engine step, the point its
loss chart draws. On the reference engine with one thread the two runs are the same run (same
replies), so the two series must be equal step for step. Writes a JSON beside the folder's report.

    python benchmarks/learning_agreement.py benchmarks/results/eval-cpu-learning --problem arith-01 \\
        --arm mix=paper
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path


async def dashboard_run(options, export: Path, timeout: float) -> dict:
    from esamp.platform.gpu import MemorySample
    from esamp_tui.app import EsampApp

    class NoMemory:  # the memory chart plays no part here
        def sample(self):
            return MemorySample("host", None, None, note="not sampled", time=time.time())

        def close(self):
            pass

    with tempfile.TemporaryDirectory() as tmp:
        app = EsampApp(options, memory_sampler=NoMemory(), theme_dir=Path(tmp), speed_file=Path(tmp) / "speed.json")
        async with app.run_test(size=(160, 48)) as pilot:
            screen = app.main_screen
            deadline = time.monotonic() + timeout
            while not (screen.record.groups and all(g.finished for g in screen.record.groups.values())):
                if screen.controller.failed or time.monotonic() > deadline:
                    raise SystemExit(f"the dashboard's run did not finish: {screen.controller.failed}")
                await pilot.pause(0.1)
            await pilot.pause(0.5)
            screen.record.export(export)
            group = next(iter(screen.record.groups.values()))
            return {"texts": [s.text for s in group.samples]}


def main() -> int:
    from esamp.core.config import EsampConfig, SamplingConfig, make_config
    from esamp.eval.runner import read_records
    from esamp_tui.options import Options

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="an esamp eval output folder (one task)")
    p.add_argument("--problem", required=True)
    p.add_argument("--arm", required=True, help="an ESamp cell of the folder")
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()

    settings = json.loads((args.folder / "run.json").read_text())["settings"]
    record = read_records(args.folder)[(args.problem, args.arm)]
    cell = settings["cells"][args.arm]
    sampling = make_config(SamplingConfig, **{k: settings[k] for k in SamplingConfig.model_fields if k in settings})
    sampling = sampling.model_copy(update={"seed": record["seed"]})
    from esamp.eval.tasks import load_task

    problem = next(x for x in load_task(settings["task"]) if x.id == args.problem)
    options = Options(
        engine="reference",
        esamp=make_config(EsampConfig, **cell),
        sampling=sampling,
        prompt=problem.prompt,
        log_file="",
        engine_options=dict(threads=1),
    )
    with tempfile.TemporaryDirectory() as tmp:
        seen = asyncio.run(dashboard_run(options, Path(tmp), args.timeout))
        metrics = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    charted = [round(m["loss"], 6) for m in metrics if m["loss"] is not None]
    stored = record["loss"]
    differences = [abs(a - b) for a, b in zip(charted, stored)]
    result = {
        "command": " ".join(["python", *sys.argv]),
        "what": __doc__.split("\n\n")[0],
        "folder": str(args.folder),
        "problem": args.problem,
        "arm": args.arm,
        "same_replies": seen["texts"] == record["texts"],
        "steps": {"dashboard": len(charted), "eval": len(stored)},
        "largest_difference": max(differences) if differences else None,
        "equal": charted == stored,
        "dashboard_loss": charted,
        "eval_loss": stored,
    }
    out = args.folder / f"dashboard-agreement-{args.problem}.json"
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(
        f"same replies: {result['same_replies']}; loss steps: dashboard {len(charted)}, eval {len(stored)}; "
        f"equal: {result['equal']} (largest difference {result['largest_difference']}); written {out}"
    )
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
