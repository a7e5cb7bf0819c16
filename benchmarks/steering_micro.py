"""Device time of ESamp's step pieces at a model's shapes, synthetic inputs, no engine: the fused
filter-and-mix (realistic and flat logits) and the graphed Distiller step (bucketed shapes).

For tuning the kernels between engine benches: one call, a table, a JSON. GPU only.

    python benchmarks/steering_micro.py --hidden 3584 --vocab 152064 --rows 16 128 256 --group-size 1 8 16
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 128, 256])
    ap.add_argument("--group-size", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    import triton.testing

    from esamp.core.backends import triton_filter as tf
    from esamp.core.backends.graphs import GraphCache
    from esamp.core.config import Filters, Steering
    from esamp.core.distiller import DistillerBank
    from esamp.core.steerer import PlanBuffers, SteeredRow, Steerer, StepPlan

    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "filter": [], "distill": []}
    R, V, H = max(args.rows), args.vocab, args.hidden
    work = tf.FilterWorkspace(R, V, dev)
    for rows in args.rows:
        for kind in ("realistic", "flat"):
            gen = torch.Generator(device=dev).manual_seed(rows)
            scale = 0.05 if kind == "flat" else 12.0  # flat: near-uniform; realistic: a few candidates
            base = (torch.randn(rows, V, device=dev, generator=gen) * scale).to(torch.bfloat16).float()
            d = torch.randn(rows, V, device=dev, generator=gen).to(torch.bfloat16)
            index = torch.arange(rows, device=dev)
            f = Filters()
            T, mp, tp = (torch.full((rows,), v, device=dev) for v in (f.temperature, f.min_p, f.top_p))
            a, b = torch.full((rows,), 1.8, device=dev), torch.full((rows,), 0.8, device=dev)
            z = base.clone()

            def step(z=z, base=base, index=index, T=T, mp=mp, tp=tp, a=a, b=b, d=d):
                z.copy_(base)
                tf.launch(z, index, T, mp, tp, a, b, d, work)

            copy_ms = triton.testing.do_bench(lambda z=z, base=base: z.copy_(base), return_mode="median")
            ms = triton.testing.do_bench(step, return_mode="median") - copy_ms
            counts = tf.launch(base.clone(), index, T, mp, tp, a, b, d, work).float()
            out["filter"].append(
                dict(rows=rows, logits=kind, us=round(1e3 * ms, 1), mean_candidates=round(float(counts.mean()), 1))
            )
            print(
                f"filter+mix {kind:>9} rows {rows:>4}: {1e3 * ms:8.1f} us  (mean |C| {float(counts.mean()):.1f})",
                flush=True,
            )
    for rows in args.rows:
        for n in args.group_size:
            if n > rows:
                continue
            units = rows // n
            bank = DistillerBank(H, rank=args.rank, slots=max(64, units), device=dev)
            for u in range(units):
                bank.allocate(f"g{u}")
            buffers = PlanBuffers(rows, units=64 if units <= 64 else units, width=64, device=dev, scratch=bank.scratch)
            plan = StepPlan.build(
                [SteeredRow(u, Steering(), Filters()) for u in range(units) for _ in range(n)],
                dev,
                index=list(range(rows)),
                buffers=buffers,
            )
            steerer = Steerer(bank, graphs=GraphCache(after=0, in_place=True, shared_pool=True))
            taps = torch.randn(rows + 1, 2 * H, device=dev, dtype=torch.bfloat16)
            taps[rows:] = 0
            x, y = taps[:, :H], taps[:, H:]
            for _ in range(3):
                steerer.distill(plan, x, y, None, torch.bfloat16)
            ms = triton.testing.do_bench(
                lambda steerer=steerer, plan=plan, x=x, y=y: steerer.distill(plan, x, y, None, torch.bfloat16),
                return_mode="median",
            )
            out["distill"].append(dict(rows=rows, group_size=n, shape=list(plan.layout.shape), us=round(1e3 * ms, 1)))
            print(f"distiller step rows {rows:>4} x n={n:<3} block {plan.layout.shape}: {1e3 * ms:8.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
