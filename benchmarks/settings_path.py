"""Host time esamp's own code spends on one served request's ESamp settings, and how often it
decodes them: the middleware's admission (``admission.admit``, which reads the body through vLLM's
request model, then the ticket), ``settings.prepare`` (vLLM's ``validate_params``, in the API
server) and ``rows.request_row`` in the engine core, once per child request. No engine, no server:
the pieces are called as the middleware and vLLM call them, on representative bodies. vLLM's own
work between them (building ``SamplingParams``, the msgspec hop) is not timed.

    PYTHONPATH=. python benchmarks/settings_path.py [--repeat 1000] [--rounds 9]

Prints, per body, microseconds per request for each piece (this thread's CPU time, the best of
``--rounds`` rounds: other processes on a busy machine only add) and the number of
``payload.decode`` calls in the API server and in the engine core. To compare with an older
commit: ``git archive OLD esamp | tar -x -C /tmp/old`` and run this script with ``PYTHONPATH=/tmp/old``.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import time

BODIES = {
    "n=1, no xargs": {"model": "m", "prompt": "Hello", "max_tokens": 16},
    "n=1, beta+mix": {
        "model": "m",
        "prompt": "Hello",
        "max_tokens": 16,
        "temperature": 0.7,
        "top_p": 0.9,
        "vllm_xargs": {"esamp_beta": 1.2, "esamp_mix": "paper"},
    },
    "n=8, seed, beta+records": {
        "model": "m",
        "prompt": "Hello",
        "max_tokens": 16,
        "n": 8,
        "seed": 5,
        "temperature": 0.8,
        "top_p": 0.95,
        "min_p": 0.1,
        "vllm_xargs": {"esamp_beta": 0.8, "esamp_records": "on"},
    },
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()

    import os

    os.environ["ESAMP_SERVE"] = "1"  # as in esamp serve's API server
    from vllm import SamplingParams

    from esamp.core import payload as pl
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm import settings as es
    from esamp.engines.vllm.rows import Groups, request_row
    from esamp.serving.admission import admit

    calls = {"n": 0}
    real_decode = pl.decode

    def counted(extra):
        calls["n"] += 1
        return real_decode(extra)

    pl.decode = counted
    holds = "settings" in inspect.signature(es.ISSUED.issue).parameters  # this tree's ticket holds the settings
    config = EsampConfig()
    print(f"settings held with the ticket: {holds}")
    print(f"{'body':26} {'admit':>8} {'prepare':>8} {'row/child':>10} {'total':>8}   decodes server, core")
    for name, body in BODIES.items():
        rounds = []
        for _ in range(args.rounds):
            t_admit = t_prepare = t_rows = 0.0
            decodes = (0, 0)
            for _ in range(args.repeat):
                request = copy.deepcopy(body)
                calls["n"] = 0
                t0 = time.thread_time()
                admission = admit(request, chat=False)  # the middleware's admission ...
                issued = es.ISSUED.issue(admission.settings) if holds else es.ISSUED.issue()
                request["vllm_xargs"] = {**(request.get("vllm_xargs") or {}), pl.ROUTE_KEYS["group"]: issued.ticket}
                t1 = time.thread_time()
                params = SamplingParams(
                    n=request.get("n", 1),
                    seed=request.get("seed"),  # vLLM's (not timed)
                    temperature=request.get("temperature", 1.0),
                    top_p=request.get("top_p", 1.0),
                    min_p=request.get("min_p", 0.0),
                    max_tokens=16,
                    extra_args=dict(request["vllm_xargs"]),
                )
                t2 = time.thread_time()
                es.prepare(params)  # vLLM's validate_params
                t3 = time.thread_time()
                server = calls["n"]
                # the engine core: n children, each with its own copy of the payload (msgspec), seed + i
                children = [
                    (dict(params.extra_args), None if params.seed is None else params.seed + i) for i in range(params.n)
                ]
                groups = Groups(None)
                t4 = time.thread_time()
                for extra, seed in children:
                    request_row(extra, seed, [], groups, config, False)
                t5 = time.thread_time()
                es.ISSUED.end(issued.ticket)
                decodes = (server, calls["n"] - server)
                t_admit += t1 - t0
                t_prepare += t3 - t2
                t_rows += (t5 - t4) / params.n
            rounds.append((t_admit, t_prepare, t_rows, decodes, params.n))
        med = [min(r[i] for r in rounds) / args.repeat * 1e6 for i in range(3)]
        n = rounds[-1][4]
        total = med[0] + med[1] + n * med[2]
        print(
            f"{name:26} {med[0]:8.1f} {med[1]:8.1f} {med[2]:10.1f} {total:8.1f}   "
            f"{rounds[-1][3][0]}, {rounds[-1][3][1]}"
        )
    print("µs per request (row: per child; total: admit + prepare + n rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
