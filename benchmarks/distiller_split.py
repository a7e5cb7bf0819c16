"""Device time of the bank's whole Distiller step (forward, backward, optimizer) with x·[A|G] in one
long product per slot and split over pieces of H (``esamp.core.distiller.split_for``), CUDA only.

Each side is the real ``DistillerBank.step`` captured as a CUDA graph and replayed, so the figures
are device time without launch overhead, as in the engine. Both sides start from the same weights
and rows; the largest difference of ŷ and of the loss after the timed steps is printed beside them.

    python benchmarks/distiller_split.py --hidden 3584 896 --shape 8x16 32x8 16x1 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

from esamp.core.distiller import DistillerBank, RowLayout, split_for


def timed(bank: DistillerBank, x, y, layout: RowLayout, replays: int) -> tuple[float, torch.Tensor, torch.Tensor]:
    """ms per replayed step, and ŷ and the loss of one more step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            bank.step(x, y, layout)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = bank.step(x, y, layout)
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / replays
    graph.replay()
    torch.cuda.synchronize()
    return ms, out[0].clone(), out[2].clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[3584, 896])
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--shape", nargs="+", default=["8x16", "32x8", "16x1"], help="UNITSxROWS: slots x rows per slot")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for H in args.hidden:
        for shape in args.shape:
            U, W = (int(v) for v in shape.split("x"))
            gen = torch.Generator(device="cpu").manual_seed(0)
            x = torch.randn(U * W, H, generator=gen).to(dev, torch.bfloat16)
            y = (x.float() + 0.5 * torch.randn(U * W, H, generator=gen).to(dev)).to(torch.bfloat16)
            layout = RowLayout.from_slots([s for s in range(U) for _ in range(W)], device=dev)
            got = {}
            for split in sorted({1, split_for(H, dev)}):
                bank = DistillerBank(H, rank=args.rank, slots=U, device=dev, split=split)
                got[split] = timed(bank, x, y, layout, args.replays)
            one, best = got[1], got[max(got)]
            row = {
                "hidden": H,
                "units": U,
                "rows_per_unit": W,
                "split": max(got),
                "step_ms_split_1": round(one[0], 4),
                "step_ms_split": round(best[0], 4),
                "max_abs_diff_prediction": float((one[1] - best[1]).abs().max()),
                "max_abs_diff_loss": float((one[2] - best[2]).abs().max()),
            }
            rows.append(row)
            print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(0),
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                    "rank": args.rank,
                    "replays": args.replays,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
