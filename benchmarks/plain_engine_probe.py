"""A plain vLLM engine with esamp installed, against the same engine with esamp's plugin kept out.

What installing esamp puts into every vLLM process of the environment is its
``vllm.general_plugins`` entry point (``esamp.engines.vllm.plugin.register``: model classes
registered by name; no logits processor, see docs/vllm.md). This runs vLLM's own ``LLM`` on the
same model and workload in fresh processes (the engine core in the process, so the runner can be
read), the sides alternating trial by trial: with esamp's
plugin loaded (as installed) and with ``VLLM_PLUGINS`` naming no plugin (vLLM then loads none:
what an environment without esamp loads). Each trial reports the engine's start time, the
throughput of one ``generate`` call, the runner vLLM chose and whether esamp was imported.

    python benchmarks/plain_engine_probe.py --trials 4 --json benchmarks/results/plain-engine-cpu.json

The child process imports only vLLM; the parent resolves the model (the embedded one by default)
with esamp's launch facts and hands the child plain engine arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
args, work = json.loads(sys.argv[1]), json.loads(sys.argv[2])
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
llm = LLM(**args)
start = time.perf_counter() - t0
params = SamplingParams(n=work["n"], max_tokens=work["tokens"], temperature=0.8, ignore_eos=True, seed=0)
prompts = [{"prompt_token_ids": ids} for ids in work["prompts"]]
llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
t1 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - t1
tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
runner = None
try:  # in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    core = llm.llm_engine.engine_core.engine_core
    runner = type(core.model_executor.driver_worker.worker.model_runner).__module__
except Exception:
    pass
print("RESULT " + json.dumps(dict(start_s=round(start, 2), seconds=round(seconds, 3), tokens=tokens,
                                  tok_s=round(tokens / seconds, 1), runner=runner,
                                  esamp_imported=any(m == "esamp" or m.startswith("esamp.") for m in sys.modules))))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model esamp resolves (default: the embedded one)")
    ap.add_argument("--trials", type=int, default=4, help="trials per side (default 4)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()

    from esamp.commands.bench import provenance
    from esamp.commands.bench.workloads import prompts
    from esamp.engines.models import resolve
    from esamp.engines.vllm import launch
    from esamp.platform.devices import cuda_available

    cuda = cuda_available()
    facts = launch.model_facts(resolve(args.model), cuda=cuda)
    engine = dict(facts.load, max_model_len=512, seed=0, **({} if cuda else {"enforce_eager": True}))
    work = dict(n=args.n, tokens=args.tokens, prompts=prompts(args.prompts, 16, facts.vocab_size, seed=1))
    base_env = dict(
        os.environ,
        **({} if cuda else launch.cpu_env()),
        VLLM_LOGGING_LEVEL="WARNING",
        PYTHONUNBUFFERED="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    sides = {
        "installed": {k: v for k, v in base_env.items() if k != "VLLM_PLUGINS"},
        "kept_out": dict(base_env, VLLM_PLUGINS="no-plugin"),
    }
    runs = []
    for t in range(args.trials):
        for side in ("installed", "kept_out") if t % 2 == 0 else ("kept_out", "installed"):
            done = subprocess.run(
                [sys.executable, "-c", CHILD, json.dumps(engine), json.dumps(work)],
                env=sides[side],
                capture_output=True,
                text=True,
                timeout=900,
            )
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                sys.stderr.write(done.stderr[-3000:])
                raise SystemExit(f"trial {t} ({side}) failed (rc {done.returncode})")
            runs.append(dict(json.loads(line[7:]), side=side, trial=t))
            print(
                f"trial {t} {side:>9}: start {runs[-1]['start_s']:6.1f} s, {runs[-1]['tok_s']:8.1f} tok/s, "
                f"esamp imported: {runs[-1]['esamp_imported']}",
                flush=True,
            )

    def per(side, key):
        return [r[key] for r in runs if r["side"] == side]

    ratios = [
        a["tok_s"] / b["tok_s"]
        for a, b in zip(
            sorted((r for r in runs if r["side"] == "installed"), key=lambda r: r["trial"]),
            sorted((r for r in runs if r["side"] == "kept_out"), key=lambda r: r["trial"]),
        )
    ]
    summary = dict(
        tok_s_ratio_median=round(statistics.median(ratios), 4),
        tok_s_ratio_min=round(min(ratios), 4),
        tok_s_ratio_max=round(max(ratios), 4),
        start_s_median={s: statistics.median(per(s, "start_s")) for s in sides},
        runners={s: sorted(set(map(str, per(s, "runner")))) for s in sides},
    )
    print(json.dumps(summary, indent=2))
    if args.json:
        out = dict(
            command=" ".join(["python", *sys.argv]),
            commit=provenance.commit(),
            device=provenance.device(),
            versions=provenance.versions(),
            model=facts.name,
            workload=dict(prompts=args.prompts, n=args.n, tokens=args.tokens),
            summary=summary,
            runs=runs,
            time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
