"""Does the Distiller learn the same on the fused kernels as on the PyTorch path? (GPU)

One prompt group of a real model: n samples of ``--steps`` tokens are sampled once (plain
sampling, transformers on the GPU), and the residual rows entering the source and target layers
are read for every position. The same rows then go, step by step, through Distiller banks of the
same seed: the PyTorch path in fp32 (the reference) and the fused kernels with each product
precision asked for. Every bank sees exactly the same rows (no sampling feedback), so any
difference is the kernels' arithmetic. Reported per bank against the reference: the mean loss over
the steps, the loss curve (largest relative difference of a 16-step window's mean) and the novelty
by position (the mean e over the group at each step; largest relative difference of a 16-step
window's mean, and the mean one).

    python benchmarks/fused_learning.py --model default --steps 256 -n 8 --json fused-learning.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

WINDOW = 16  # steps per point of the curves compared


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default", help="what esamp's --model takes (a real model)")
    ap.add_argument("--prompt", default="Write a short story about a lighthouse keeper who finds a map.")
    ap.add_argument("-n", type=int, default=8)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--precision", nargs="+", default=["tf32", "tf32x3"])
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the kernels in Triton's interpreter (a check)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from esamp.core.config import EsampConfig
    from esamp.core.distiller import DistillerBank, RowLayout, TapNorm, TapNorms
    from esamp.engines.base import resolve_layer
    from esamp.engines.models import resolve

    dev = torch.device(args.device)
    resolved = resolve(None if args.model == "default" else args.model)
    path = resolved.hf_dir()
    tok = AutoTokenizer.from_pretrained(path)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    config = EsampConfig()
    layers = model.model.layers
    src = resolve_layer(config.source_layer, len(layers), "source")
    tgt = resolve_layer(config.target_layer, len(layers), "target")

    def tap_norm(module) -> TapNorm:
        eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        gemma = "Gemma" in type(module).__name__
        return TapNorm(module.weight.detach(), eps, 1.0 if gemma else 0.0)

    norms = TapNorms(tap_norm(layers[src].input_layernorm), tap_norm(layers[tgt].input_layernorm))

    messages = [{"role": "user", "content": args.prompt}]
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # a base model without a chat template
        text = args.prompt
    prompt = tok(text, return_tensors="pt").input_ids.to(dev)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        seqs = model.generate(
            prompt.repeat(args.n, 1),
            do_sample=True,
            temperature=0.8,
            top_p=0.95,
            max_new_tokens=args.steps,
            min_new_tokens=args.steps,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        )
    taps: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(_module, inputs):
            taps[name] = inputs[0].detach()

        return hook

    handles = [
        layers[src].input_layernorm.register_forward_pre_hook(keep("x")),
        layers[tgt].input_layernorm.register_forward_pre_hook(keep("y")),
    ]
    with torch.inference_mode():
        model(seqs)
    for h in handles:
        h.remove()
    sampled = time.perf_counter() - t0
    start = prompt.shape[1] - 1  # the first step's rows: the prompt's last position
    steps = min(args.steps, seqs.shape[1] - start)

    def run(backend: str, precision: str | None):
        bank = DistillerBank(
            model.config.hidden_size,
            rank=config.rank,
            slots=1,
            lr=config.lr,
            optimizer=args.optimizer,
            device=dev,
            seed=config.seed,
            backend=backend,
        )
        bank.precision = precision
        bank.allocate("group")
        layout = RowLayout.from_slots([0] * args.n, device=dev)
        losses, novelty = [], []
        with torch.inference_mode():
            for t in range(steps):
                x = taps["x"][:, start + t].contiguous()
                y = taps["y"][:, start + t].contiguous()
                _, err, loss = bank.step(x, y, layout, norms)
                losses.append(loss[0].clone())  # (the fused step's outputs live until its next step)
                novelty.append(err[: args.n].mean())
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return torch.stack(losses).double().cpu(), torch.stack(novelty).double().cpu(), bank.fused(x, y, norms)

    ref_loss, ref_novelty, _ = run("torch", None)
    out = {
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (Triton's interpreter)",
        "torch": torch.__version__,
        "model": resolved.name,
        "n": args.n,
        "steps": steps,
        "sampling_seconds": round(sampled, 1),
        "reference": {
            "path": "torch fp32",
            "mean_loss": float(ref_loss.mean()),
            "mean_novelty": float(ref_novelty.mean()),
        },
        "fused": [],
    }

    window = min(WINDOW, steps)

    def windows(v):
        return v[: steps // window * window].view(-1, window).mean(dim=1)

    print(f"{resolved.name}: n={args.n}, {steps} steps; reference mean loss {float(ref_loss.mean()):.5f}")
    for precision in args.precision:
        loss, novelty, fused = run("fused", precision)
        rel = lambda a, b: (a - b).abs() / b.abs().clamp(min=1e-12)  # noqa: E731
        row = dict(
            precision=precision,
            fused=fused,
            mean_loss=float(loss.mean()),
            mean_loss_rel_diff=float(rel(loss.mean(), ref_loss.mean())),
            loss_curve_max_rel_diff=float(rel(windows(loss), windows(ref_loss)).max()),
            novelty_by_position_max_rel_diff=float(rel(windows(novelty), windows(ref_novelty)).max()),
            novelty_by_position_mean_rel_diff=float(rel(novelty, ref_novelty).mean()),
            first_and_last_window_loss=[float(windows(loss)[0]), float(windows(loss)[-1])],
        )
        out["fused"].append(row)
        print(
            f"  fused {precision:<7} mean loss {row['mean_loss']:.5f} ({100 * row['mean_loss_rel_diff']:.3f}%), "
            f"loss curve max {100 * row['loss_curve_max_rel_diff']:.3f}%, novelty by position max "
            f"{100 * row['novelty_by_position_max_rel_diff']:.3f}% "
            f"mean {100 * row['novelty_by_position_mean_rel_diff']:.3f}%"
        )
    out["reference"]["first_and_last_window_loss"] = [float(windows(ref_loss)[0]), float(windows(ref_loss)[-1])]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
