"""Device time of the Distiller's forward + backward under different weight layouts (CUDA only).

The bank's step is a handful of batched GEMMs over [U slots, W rows, H] blocks with rank r. The
weight gradients are GEMMs with an inner dimension of only W rows, and cuBLAS picks its kernel
from the operands' shapes and orientation, so the same arithmetic can cost several times more in
one layout than in another. Each variant is captured as a CUDA graph and replayed, so the figures
are device time without launch overhead. (A transposed variant's weight gradient comes back
strided; the bank would have to copy it before its fused optimizer, which this does not time.)

    python benchmarks/distiller_layouts.py --hidden 3584 --rank 64 --shape 16x1 32x8
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def step(x, up_w, gate_w, b, out_w, ln_w, ln_b, y, transposed: bool, combined: bool):
    if combined:  # one GEMM gives [up | gate]
        both = torch.bmm(x, up_w.transpose(1, 2) if transposed else up_w)
        r = both.shape[-1] // 2
        up, pre = both[..., :r], both[..., r:]
    else:
        up = torch.bmm(x, up_w.transpose(1, 2) if transposed else up_w)
        pre = torch.bmm(x, gate_w.transpose(1, 2) if transposed else gate_w)
    gate = F.silu(pre + b.unsqueeze(1))
    out = x + torch.bmm(up * gate, out_w)
    out = F.layer_norm(out, (x.shape[-1],), eps=1e-5) * ln_w.unsqueeze(1) + ln_b.unsqueeze(1)
    loss = (out - y).pow(2).mean(-1).mean(-1).sum()
    params = [p for p in (up_w, gate_w, b, out_w, ln_w, ln_b) if p is not None]
    return torch.autograd.grad(loss, params)


def variant(name: str, U: int, W: int, H: int, r: int, dev):
    f = dict(device=dev, dtype=torch.float32)
    transposed = "T" in name
    combined = "AG" in name
    width = 2 * r if combined else r
    strided = name.startswith("flat")
    if strided:  # views into one [U, P] buffer, as the bank stores them
        P = 3 * H * r + r + 2 * H
        flat = torch.randn(U, P, **f) * 0.02
        up_w = flat[:, : H * r].view(U, H, r)
        gate_w = flat[:, H * r : 2 * H * r].view(U, H, r)
        out_w = flat[:, 2 * H * r : 3 * H * r].view(U, r, H)
        b = flat[:, 3 * H * r : 3 * H * r + r]
        ln_w = flat[:, 3 * H * r + r : 3 * H * r + r + H]
        ln_b = flat[:, 3 * H * r + r + H :]
    else:
        shape = (U, width, H) if transposed else (U, H, width)
        up_w = torch.randn(*shape, **f) * 0.02
        gate_w = None if combined else torch.randn(*shape, **f) * 0.02
        out_w = torch.randn(U, r, H, **f) * 0.02
        b, ln_w, ln_b = torch.ones(U, r, **f), torch.ones(U, H, **f), torch.zeros(U, H, **f)
    tensors = [t.requires_grad_(True) if t is not None else None for t in (up_w, gate_w, b, out_w, ln_w, ln_b)]
    x, y = torch.randn(U, W, H, **f), torch.randn(U, W, H, **f)
    return lambda: step(x, *tensors, y, transposed, combined)


def time_graph(fn, iters: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--shape", nargs="+", default=["16x1", "32x8"], help="UxW: slots x rows per slot")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    names = [
        "flat, A,G apart (the bank before)",
        "A,G [H,r]",
        "A,G stored [r,H] (T)",
        "AG [H,2r] (the bank's layout)",
        "AG stored [2r,H] (T)",
    ]
    rows = []
    for shape in args.shape:
        U, W = (int(v) for v in shape.split("x"))
        for name in names:
            ms = time_graph(variant(name, U, W, args.hidden, args.rank, dev), args.iters)
            rows.append(dict(slots=U, rows_per_slot=W, layout=name, fwd_bwd_ms=round(ms, 4)))
            print(f"U={U:>3} W={W:>2}  {name:<34} {ms:.4f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    device=torch.cuda.get_device_name(0),
                    torch=torch.__version__,
                    hidden=args.hidden,
                    rank=args.rank,
                    rows=rows,
                ),
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
