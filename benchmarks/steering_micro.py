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
        _DEFAULT_TILES.update({name: getattr(kernels, name) for name in kernels.TILES}, WARPS=dict(kernels.WARPS))
    for name in kernels.TILES:
        setattr(kernels, name, _DEFAULT_TILES[name])
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
    """The filter-and-mix with d given two ways, and what each costs beside vLLM's own head:
    ``dense``: d from the LM head run on [h; ŷ] (a [2·rows, H]·[H, V] GEMM instead of the
    [rows, H] one), then the mix reading d; ``factors``: vLLM's head on h only and d computed at
    the candidates from ŷ and W (``intervention.HeadProduct``). ``added_us``: the GEMM's extra time
    (dense) plus the filter-and-mix, over the head on h alone."""
    import torch
    import triton.testing

    from esamp.core import intervention as iv
    from esamp.core.backends import triton_filter as tf
    from esamp.core.config import Filters

    dev = torch.device("cuda")
    R, V, H = max(args.rows), args.vocab, args.hidden
    work = tf.FilterWorkspace(R, V, dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    head = (torch.randn(V, H, device=dev, generator=gen) * H**-0.5).to(torch.bfloat16)
    for rows in args.rows:
        h = torch.randn(rows, H, device=dev, generator=gen).to(torch.bfloat16)
        yhat = torch.randn(rows, H, device=dev, generator=gen).to(torch.bfloat16)
        both = torch.cat([h, yhat])
        gemm = {
            n: triton.testing.do_bench(lambda x=x: x @ head.t(), return_mode="median")
            for n, x in (("h", h), ("h_yhat", both))
        }
        for kind in ("realistic", "flat"):
            scale = 0.05 if kind == "flat" else 12.0  # flat: near-uniform; realistic: a few candidates
            base = (torch.randn(rows, V, device=dev, generator=gen) * scale).to(torch.bfloat16).float()
            index = torch.arange(rows, device=dev)
            f = Filters()
            T, mp, tp = (torch.full((rows,), v, device=dev) for v in (f.temperature, f.min_p, f.top_p))
            a, b = torch.full((rows,), 1.8, device=dev), torch.full((rows,), 0.8, device=dev)
            z = base.clone()
            copy_ms = triton.testing.do_bench(lambda z=z, base=base: z.copy_(base), return_mode="median")
            for form, d in (("dense", (both @ head.t())[rows:]), ("factors", iv.HeadProduct(yhat, head))):
                for cut in (True, False):

                    def step(z=z, base=base, index=index, T=T, mp=mp, tp=tp, a=a, b=b, d=d, cut=cut):
                        z.copy_(base)
                        tf.launch(z, index, T, mp, tp, a, b, d, work, cut)

                    ms = triton.testing.do_bench(step, return_mode="median") - copy_ms
                    launches, _, _ = profile(step, 5)
                    counts = tf.launch(base.clone(), index, T, mp, tp, a, b, d, work, cut).float()
                    extra = gemm["h_yhat"] - gemm["h"] if form == "dense" else 0.0
                    row = dict(
                        rows=rows,
                        logits=kind,
                        d=form,
                        top_p_passes=cut,
                        us=round(1e3 * ms, 1),
                        head_extra_us=round(1e3 * extra, 1),
                        added_us=round(1e3 * (ms + extra), 1),
                        launches=launches - 1,  # less the copy of the logits
                        mean_candidates=round(float(counts.mean()), 1),
                    )
                    out.append(row)
                    print(
                        f"filter+mix {kind:>9} rows {rows:>4} d {form:<7} top-p passes {cut!s:<5}: {row['us']:8.1f} us "
                        f"+ head {row['head_extra_us']:6.1f} = {row['added_us']:8.1f} us, {row['launches']} launches "
                        f"(mean |C| {row['mean_candidates']})",
                        flush=True,
                    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument(
        "--blocks",
        nargs="*",
        default=["8x16", "32x8", "16x1", "1x128"],
        help="UxW Distiller blocks (none: no Distiller case)",
    )
    ap.add_argument("--distiller", nargs="+", default=["torch", "fused"], choices=["torch", "fused"])
    ap.add_argument("--precision", nargs="+", default=["tf32"], help="the fused kernels' products")
    ap.add_argument("--update", nargs="+", default=["beside", "inline"], choices=["beside", "inline"])
    ap.add_argument(
        "--tiles",
        nargs="+",
        default=[""],
        help="fused kernels' tiles to try, each NAME=V,... over triton_distiller's BK, SUBS, BH, KB, LP and "
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
