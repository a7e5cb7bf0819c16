"""Device time of ESamp's step pieces at a model's shapes, synthetic inputs, no engine: the
Distiller step (evaluate and update, as the vLLM engine runs them: CUDA graphs, the update on a
side stream or in line) on the PyTorch path and on the fused kernels, and the fused
filter-and-mix (realistic and flat logits).

For tuning the kernels between engine benches: one call, a table, a JSON. GPU only. Each
Distiller row gives the step's device time (median over replays, ``triton.testing.do_bench``) and,
from one profiled run of ``--profile-steps`` steps, its kernels per step and their summed time.

    python benchmarks/steering_micro.py --blocks 8x16 32x8 16x1 1x128 --json micro.json
    python benchmarks/steering_micro.py --no-filter --distiller fused --precision tf32 tf32x3 ieee
"""

from __future__ import annotations

import argparse
import json
import sys


def parse_block(text: str) -> tuple[int, int]:
    units, width = text.lower().split("x")
    return int(units), int(width)


def distiller_case(args, backend: str, precision: str | None, units: int, width: int, update: str) -> dict:
    """One Distiller step at a [units, width] block of 7B-shaped bf16 taps, as the engine runs it."""
    import torch
    import triton.testing

    from esamp.core.backends.graphs import GraphCache, SideStream
    from esamp.core.config import Filters, Steering
    from esamp.core.distiller import DistillerBank, TapNorm, TapNorms
    from esamp.core.steerer import PlanBuffers, SteeredRow, Steerer, StepPlan

    dev = torch.device("cuda")
    H = args.hidden
    rows = units * width
    shared = units == 1 and width > 16  # one unit as wide as the batch: the shared Distiller
    bank = DistillerBank(H, rank=args.rank, slots=max(args.slots, units), device=dev, shared=shared, backend=backend)
    bank.precision = precision
    groups = [f"g{u}" for u in range(units)]
    slots = [bank.allocate(g) for g in groups]
    buffers = PlanBuffers(rows, units=max(64, units), width=max(64, width), device=dev, scratch=bank.scratch)
    bank.reserve(rows + 1, buffers.cells)
    plan = StepPlan.build(
        [SteeredRow(slots[u], Steering(), Filters(), group=groups[u]) for u in range(units) for _ in range(width)],
        dev,
        index=list(range(rows)),
        buffers=buffers,
    )
    graphs = GraphCache(after=0, in_place=True, shared_pool=True)
    beside = SideStream(GraphCache(after=0, in_place=True)) if update == "beside" else None
    steerer = Steerer(bank, graphs=graphs, beside=beside)
    gen = torch.Generator(device=dev).manual_seed(units * 1000 + width)
    taps = (torch.randn(rows + 1, 2 * H, device=dev, generator=gen) * 3).to(torch.bfloat16)
    taps[rows:] = 0
    x, y = taps[:, :H], taps[:, H:]
    w = (0.5 + torch.rand(H, device=dev, generator=gen)).to(torch.bfloat16)
    norms = TapNorms(TapNorm(w, 1e-6), TapNorm(w.flip(0), 1e-6))

    def step():
        return steerer.distill(plan, x, y, norms, torch.bfloat16)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")
    launches, kernel_us, by_kernel = profile(step, args.profile_steps)
    return dict(
        by_kernel=by_kernel,
        backend=backend,
        precision=precision or "",
        update=update,
        block=f"{units}x{width}",
        rows=rows,
        us=round(1e3 * ms, 1),
        launches_per_step=launches,
        kernel_us_per_step=kernel_us,
        fused=bank.fused(x, y, norms),
        graphs=graphs.captures,
    )


_DEFAULT_TILES: dict = {}


def use_tiles(spec: str) -> None:
    """The fused kernels' tiles from ``NAME=V,...`` (``--tiles``) over their defaults; "" restores them."""
    from esamp.core.backends import triton_distiller as kernels

    if not _DEFAULT_TILES:
        _DEFAULT_TILES.update(BK=kernels.BK, SUBS=kernels.SUBS, BH=kernels.BH, KB=kernels.KB, WARPS=dict(kernels.WARPS))
    kernels.BK, kernels.SUBS, kernels.BH, kernels.KB = (_DEFAULT_TILES[k] for k in ("BK", "SUBS", "BH", "KB"))
    kernels.WARPS.update(_DEFAULT_TILES["WARPS"])
    kernels.set_tiles(spec)


def profile(fn, steps: int) -> tuple[float, float, dict]:
    """Kernels per call of ``fn``, their summed device time per call (µs), and that time per kernel
    name, from the profiler."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity

    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not _is_copy(e.name)]
    total = sum(e.device_time for e in kernels)
    by_name = collections.Counter()
    for e in kernels:
        by_name[e.name[:60]] += e.device_time / steps
    return round(len(kernels) / steps, 1), round(total / steps, 1), {k: round(v, 1) for k, v in by_name.most_common(8)}


def _is_copy(name: str) -> bool:
    return name.startswith("Memcpy") or name.startswith("Memset")


def filter_cases(args, out: list) -> None:
    import torch
    import triton.testing

    from esamp.core.backends import triton_filter as tf
    from esamp.core.config import Filters

    dev = torch.device("cuda")
    R, V = max(args.rows), args.vocab
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
            out.append(
                dict(rows=rows, logits=kind, us=round(1e3 * ms, 1), mean_candidates=round(float(counts.mean()), 1))
            )
            print(f"filter+mix {kind:>9} rows {rows:>4}: {1e3 * ms:8.1f} us  (mean |C| {float(counts.mean()):.1f})")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--blocks", nargs="+", default=["8x16", "32x8", "16x1", "1x128"], help="UxW Distiller blocks")
    ap.add_argument("--distiller", nargs="+", default=["torch", "fused"], choices=["torch", "fused"])
    ap.add_argument("--precision", nargs="+", default=["tf32"], help="the fused kernels' products")
    ap.add_argument("--update", nargs="+", default=["beside", "inline"], choices=["beside", "inline"])
    ap.add_argument(
        "--tiles",
        nargs="+",
        default=[""],
        help="fused kernels' tiles to try, each NAME=V,... over triton_distiller's BK, SUBS, BH, KB and "
        "warps e1..l2 (e.g. BH=64,l1=4); the empty default: its own",
    )
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 128, 256], help="filter rows")
    ap.add_argument("--no-filter", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    out = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": "python " + " ".join(sys.argv),
        "distill": [],
        "filter": [],
    }
    print(f"{'block':>7} {'path':<14} {'update':<7} {'us/step':>8} {'kernels':>8} {'kernel us':>10}", flush=True)
    for block in args.blocks:
        units, width = parse_block(block)
        for backend in args.distiller:
            for precision in args.precision if backend == "fused" else [None]:
                for tiles in args.tiles if backend == "fused" else [""]:
                    use_tiles(tiles)
                    for update in args.update:
                        row = distiller_case(args, backend, precision, units, width, update)
                        row["tiles"] = tiles
                        out["distill"].append(row)
                        name = backend + (f"/{precision}" if precision else "") + (f" {tiles}" if tiles else "")
                        print(
                            f"{block:>7} {name:<14} {update:<7} {row['us']:8.1f} {row['launches_per_step']:8.1f} "
                            f"{row['kernel_us_per_step']:10.1f}",
                            flush=True,
                        )
                        if backend == "fused" and update == args.update[0]:
                            print("        " + "  ".join(f"{k[:24]} {v}" for k, v in row["by_kernel"].items()))
                    use_tiles("")
    fused = [r for r in out["distill"] if r["backend"] == "fused"]
    if fused:  # per block, the tiles with the least kernel time
        out["best_tiles"] = {}
        for block in args.blocks:
            rows = [r for r in fused if r["block"] == block]
            if rows:
                best = min(rows, key=lambda r: r["kernel_us_per_step"])
                out["best_tiles"][block] = best["tiles"]
                print(
                    f"{block}: least kernel time with tiles {best['tiles'] or '(defaults)'}: "
                    f"{best['kernel_us_per_step']} us"
                )
    if not args.no_filter:
        filter_cases(args, out["filter"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
