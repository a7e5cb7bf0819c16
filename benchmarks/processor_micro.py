"""Per-step device cost of ESamp's pieces at a model's shapes, timed with CUDA events.

No engine: synthetic logits, taps and LM head of the given size. Each case is timed as the median
over ``--iters`` runs (after warm-up) of one step's worth of work on one stream:

- ``head``: the LM head on R rows, and on [h; ŷ] (2R rows: what the fused Distiller logits cost);
- ``filter_core``: the core's candidate filter at full width (the sort-based path);
- ``filter_vllm``: min-p plus vLLM's own top-k/top-p function (what the processor runs now);
- ``mix``: z' = a·z̃ − b·d in place, with |C| per row (the fused kernel the processor runs);
- ``distiller``: one predict-and-train step of the bank (U groups of R/U rows), eager, and
  ``distiller_graph`` the same step replayed as a CUDA graph (what the processor does on a
  steady batch);
- ``sampler_tail``: what vLLM's sampler does after the processor (softmax, exponential draw).

    python benchmarks/processor_micro.py --hidden 3584 --vocab 152064 --rows 16 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return round(statistics.median(times), 4)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--group-size", type=int, nargs="+", default=[1, 8], help="rows per group, per --rows entry")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--flat", action="store_true", help="near-uniform logits (random weights): |C| ≈ top-p · V")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="also print the CUDA kernels of one eager Distiller step (torch.profiler)")
    args = ap.parse_args()

    from esamp.core import intervention as iv
    from esamp.core.distiller import DistillerBank, RowLayout
    from esamp.core.backends.triton_mix import mix_and_count
    from esamp.engines.vllm.processor import _GraphedStep, filter_candidates

    dev = torch.device("cuda")
    H, V = args.hidden, args.vocab
    head = (torch.randn(V, H, device=dev) * 0.02).to(torch.bfloat16)
    results = []
    for R, per in zip(args.rows, args.group_size * len(args.rows)):
        U = max(1, R // per)
        scale = 0.001 if args.flat else 1.0
        h = (torch.randn(R, H, device=dev) * scale).to(torch.bfloat16)
        yhat = torch.randn(R, H, device=dev)
        z = (h @ head.t()).float() * (1.0 if args.flat else 50.0)
        temp = torch.full((R, 1), 0.8, device=dev)
        top_p = torch.full((R,), 0.95, device=dev)
        min_p = torch.full((R, 1), 0.1, device=dev)
        a = torch.full((R, 1), 1.8, device=dev)
        nb = torch.full((R, 1), -0.8, device=dev)
        d = (yhat.to(torch.bfloat16) @ head.t())
        bank = DistillerBank(H, rank=args.rank, slots=max(64, U), device=dev)
        for g in range(U):
            bank.allocate(f"g{g}")
        layout = RowLayout.from_slots([r // per for r in range(R)], dev)
        x, y = torch.randn(R, H, device=dev), torch.randn(R, H, device=dev)

        def head_plain():
            return h @ head.t()

        def head_fused():
            return torch.cat([h, yhat.to(torch.bfloat16)]) @ head.t()

        def filter_core():
            s = iv.scale_logits(z, temp.reshape(-1))
            return iv.candidate_mask(s, torch.zeros(R, dtype=torch.long, device=dev), top_p, min_p.reshape(-1),
                                     width=V)

        def filter_vllm():
            return filter_candidates(z.clone().div_(temp), None, top_p, min_p)

        filtered = filter_vllm()

        def mix():
            return mix_and_count(filtered.clone(), d, a, nb)

        def distiller():
            return bank.predict_and_train(x, y, layout)

        graphed = _GraphedStep(None, lambda gx, gy: bank.predict_and_train(gx, gy, layout), x, y)

        def distiller_graph():
            return graphed.run(x, y)

        def sampler_tail():
            probs = filtered.softmax(dim=-1)
            q = torch.empty_like(probs).exponential_()
            return probs.div_(q).argmax(dim=-1)

        def clone_only():
            return filtered.clone()

        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    distiller()
                torch.cuda.synchronize()
            print(f"-- Distiller step kernels, R={R}, U={U} (5 steps) --")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18), flush=True)

        row = dict(rows=R, groups=U, hidden=H, vocab=V,
                   candidates_mean=float(torch.isfinite(filtered).sum(-1).float().mean()))
        for name, fn in [("head", head_plain), ("head_fused", head_fused), ("filter_core", filter_core),
                         ("filter_vllm", filter_vllm), ("clone", clone_only), ("mix", mix),
                         ("distiller", distiller), ("distiller_graph", distiller_graph),
                         ("sampler_tail", sampler_tail)]:
            row[name + "_ms"] = timed(fn, args.iters)
        row["mix_ms"] = round(row["mix_ms"] - row["clone_ms"], 4)
        row["filter_vllm_ms"] = round(row["filter_vllm_ms"] - row["clone_ms"], 4)
        row["fused_head_extra_ms"] = round(row["head_fused_ms"] - row["head_ms"], 4)
        print(json.dumps(row), flush=True)
        results.append(row)
    report = dict(command=" ".join(["python", *sys.argv]), device=torch.cuda.get_device_name(0),
                  versions=dict(torch=torch.__version__), flat=args.flat, results=results)
    try:
        import vllm

        report["versions"]["vllm"] = vllm.__version__
    except Exception:
        pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
