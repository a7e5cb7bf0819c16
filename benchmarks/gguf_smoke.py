"""The embedded GGUF model on vLLM with ESamp on: does it say something sensible?

Run on the GPU machine by ``benchmarks/gpu_suite.sh tests``: the model either as the cached bf16
HF directory (``--gguf convert``, the engine's default) or read by vLLM 0.20 itself (``--gguf
native``: fp16 activations, tokenizer from the converted directory); n=4 samples with ESamp on
and then off, same seed. Writes the texts, the Distiller's loss curve and the versions to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.environ.get("ESAMP_TEST_GGUF", "/tmp/models/smollm2.Q4_1.gguf"))
    ap.add_argument("--json", required=True)
    ap.add_argument(
        "--gguf",
        choices=("convert", "native"),
        default="convert",
        help="convert: the cached bf16 HF directory; native: vLLM reads the GGUF (fp16)",
    )
    ap.add_argument("--plain", action="store_true", help="plain vLLM (no ESamp model class or processor)")
    args = ap.parse_args()
    import torch
    import vllm

    from esamp.core.config import EsampConfig, SamplingConfig, Steering
    from esamp.engines.base import run
    from esamp.engines.vllm.engine import VllmEngine

    t0 = time.perf_counter()
    eng = VllmEngine(
        model=args.model,
        esamp=EsampConfig(),
        max_model_len=2048,
        gpu_memory_utilization=0.3,
        gguf=args.gguf,
        plain=args.plain,
        enforce_eager=True if args.gguf == "native" else None,
    )
    load = time.perf_counter() - t0
    prompt = "What is the capital of France? Answer in one sentence."
    out = {
        "command": " ".join(["python3", *sys.argv]),
        "model": args.model,
        "load_seconds": round(load, 1),
        "device": torch.cuda.get_device_name(0),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gguf": args.gguf,
        "plain": args.plain,
        "engine_info": eng.info(),
        "prompt": prompt,
        "runs": {},
    }
    variants = [("esamp_off", Steering(enabled=False))]
    if not args.plain:
        variants.insert(0, ("esamp_on", Steering()))
    for label, es in variants:
        events = list(run(eng, prompt, SamplingConfig(n=4, max_tokens=48, seed=0), es))
        texts = ["".join(e.text for e in events if e.type == "token" and e.sample == s) for s in range(4)]
        losses = [e.loss for e in events if e.type == "step" and e.loss is not None]
        ids = [[e.token_id for e in events if e.type == "token" and e.sample == s] for s in range(4)]
        out["runs"][label] = {
            "texts": texts,
            "token_ids": ids,
            "losses": losses,
            "port_hits": sum(e.port_hits for e in events if e.type == "step"),
            "mentions_paris": sum("Paris" in t for t in texts),
        }
        print(label, json.dumps(texts, ensure_ascii=False))
    out["counters"] = eng.drain().get("counters", {})
    eng.close()
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=2, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
