"""ESamp's host time per steady step on Model Runner V2's path, without an engine.

Drives the MRV2 adapter's work (``late.LateAdapter``, what ``mrv2.Mrv2Adapter`` runs) on the
engine's own ``StepExchange`` and ``EngineSteering`` at a model's shapes, synthetic inputs: a
stand-in for the tap model keeps the taps (``put_taps_late``, as ``model.py`` does on every step),
then the adapter's ``apply`` runs the Distiller step, the filter and mix and the record on a
fixed batch (P prompt groups of n samples, the fair workload's filters by default). No model, no
vLLM engine, no other thread: what is left is ESamp's own host work and the driver calls it makes.

Each step is timed alone (the device drained before it, outside the timing, so no step waits on a
full launch queue): wall time and the thread's CPU time of the adapter's ``apply`` and of the
model's side, the steering's own split of the steady steps (``metrics()``), and cProfile's
functions over ``--profile`` more steady steps and as many plan rebuilds. A plan rebuild (a batch change) is timed apart
(``--rebuilds``). It measures, it asserts nothing. Runs on a CPU too (no graphs there: only for
trying the script).

    python benchmarks/host_micro.py --json host-micro.json
    python benchmarks/host_micro.py --prompts 32 -n 8 --min-p 0.1 --top-p 0.95 --profile 200
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from types import SimpleNamespace


def _config(args, max_rows: int):
    """What the adapter and ``make_steering`` read of a ``VllmConfig``."""
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm import settings as es

    esamp = EsampConfig(distiller=args.distiller)
    return SimpleNamespace(
        model_config=SimpleNamespace(
            get_vocab_size=lambda: args.vocab, get_hidden_size=lambda: args.hidden, logits_processors=None
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=max_rows),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, enable_batch_sharded_sampling=False),
        speculative_config=None,
        additional_config={es.KEY: es.engine_settings(esamp, args.layers)},
    )


class _TapModel:
    """The tap model's side of a step as ``model._TapMixin.compute_logits`` runs it with a late
    adapter: ``begin``, ``warm_up`` (nothing once prepared), ``put_taps_late``."""

    esamp_head_sharded = False

    def __init__(self, exchange, head, norms) -> None:
        self.exchange, self.head, self.norms = exchange, head, norms
        exchange.attach_model(self)

    def esamp_dense_weight(self):
        return self.head

    def esamp_lm_head(self):
        return self.head

    def compute_logits(self, aux, dtype) -> None:
        x = self.exchange
        if x.begin(aux.shape[0]) is None:
            x.warm_up(aux, 0, 1, self.norms, dtype)
            x.put_taps_late(aux, 0, 1, self.norms, dtype)


def _params(temperature: float, top_p: float, min_p: float, top_k: int):
    """A ``SamplingParams``'s fields that ``settings.prepare`` reads and writes."""
    return SimpleNamespace(
        n=1,
        seed=None,
        extra_args=None,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
    )


# The calls a steady step makes that ``_pieces`` times, as (what, attribute path from the adapter).
PIECES = (
    ("adapter apply (all)", "apply"),
    ("steering.step_late", "steering.step_late"),
    ("one-graph step (all)", "steering._fused_step"),
    ("steering.distill", "steering.distill"),
    ("bank.settle", "steering.bank.settle"),
    ("Distiller graph run", "steering.steerer.graphs.run"),
    ("update beside (SideStream.run)", "steering.steerer.beside.run"),
    ("steering.apply", "steering.apply"),
    ("padded step (all)", "steering._padded_step"),
    ("padded graph run", "steering.padded_graphs.run"),
    ("records.push_staged", "steering.records.push_staged"),
)


def _pieces(adapter, steering, step, steps: int) -> dict[str, float]:
    """Mean host µs a step of each of ``PIECES``, over ``steps`` more steps with each wrapped in a
    timer (as instance attributes: nothing outside this run sees them), then unwrapped."""
    spent = dict.fromkeys([name for name, _ in PIECES], 0.0)
    wrapped = []
    for name, path in PIECES:
        *parents, attr = path.split(".")
        owner = adapter
        for part in parents:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, attr):
            continue
        inner = getattr(owner, attr)

        def timed(*a, _inner=inner, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                spent[_name] += time.perf_counter() - t0

        setattr(owner, attr, timed)
        wrapped.append((owner, attr))
    try:
        for _ in range(steps):
            step()
    finally:
        for owner, attr in wrapped:
            delattr(owner, attr)
    return {name: round(1e6 * t / steps, 2) for name, t in spent.items()}


def _summary(values: list[float]) -> dict:
    ms = sorted(1e3 * v for v in values)
    return dict(
        mean=round(statistics.fmean(ms), 4),
        median=round(statistics.median(ms), 4),
        p90=round(ms[int(0.9 * (len(ms) - 1))], 4),
        min=round(ms[0], 4),
    )


def primitives(device, repeat: int = 2000) -> dict[str, float]:
    """Host µs per call (median of ``repeat``) of the calls a steady step makes, one at a time."""
    import torch

    stream = torch.cuda.Stream()
    event = torch.cuda.Event()
    small = torch.zeros(1, dtype=torch.long, device=device)
    packed = torch.zeros(513, device=device)
    host = torch.empty(513, pin_memory=True)
    a = torch.zeros(256, 64, device=device)
    graphs = {}
    for kernels in (1, 16, 64):
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            a.add_(1)  # warm
            graph.capture_begin()
            for _ in range(kernels):
                a.add_(1)
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        graphs[kernels] = graph
    calls = {
        "perf_counter": time.perf_counter,
        "current_stream": torch.cuda.current_stream,
        "event.record": event.record,
        "current_stream.wait_event": lambda: torch.cuda.current_stream().wait_event(event),
        "with torch.cuda.stream": lambda: _enter_exit(torch.cuda.stream(stream)),
        "set_stream x2": lambda: (torch.cuda.set_stream(stream), torch.cuda.set_stream(torch.cuda.default_stream())),
        "fill_ (1 long)": lambda: small.fill_(7),
        "copy_ to pinned, non_blocking": lambda: host.copy_(packed, non_blocking=True),
        "tensor.data_ptr": small.data_ptr,
        "graph.replay 1 kernel": graphs[1].replay,
        "graph.replay 16 kernels": graphs[16].replay,
        "graph.replay 64 kernels": graphs[64].replay,
    }
    out = {}
    for name, call in calls.items():
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
            if len(times) % 64 == 0:
                torch.cuda.synchronize()
        out[name] = round(1e6 * statistics.median(times), 2)
    torch.cuda.synchronize()
    return out


def _enter_exit(context) -> None:
    with context:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=3584, help="hidden size (default: Qwen2.5-7B's)")
    ap.add_argument("--vocab", type=int, default=152064, help="vocabulary (default: Qwen2.5-7B's)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--prompts", type=int, default=8, help="prompt groups in the batch (default: fair's 8)")
    ap.add_argument("-n", type=int, default=16, help="samples per group (default: fair's 16)")
    ap.add_argument("--max-rows", type=int, default=256, help="the engine's max_num_seqs")
    ap.add_argument("--distiller", choices=("bank", "shared"), default="bank")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.05)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50, help="steps before the timed ones")
    ap.add_argument("--steps", type=int, default=400, help="timed steady steps")
    ap.add_argument("--rebuilds", type=int, default=20, help="timed steps with a plan rebuild (rows reordered)")
    ap.add_argument("--profile", type=int, default=200, help="steps under cProfile after the timed ones (0: none)")
    ap.add_argument("--top", type=int, default=30, help="cProfile's functions listed")
    ap.add_argument("--device", default=None, help="default: cuda when there is one")
    ap.add_argument("--primitives", action="store_true", help="also time the driver calls a step makes, one by one")
    ap.add_argument(
        "--no-sync", action="store_true", help="leave the device's queue running between timed steps (default: drained)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from esamp.commands.bench import provenance
    from esamp.core.config import Steering
    from esamp.core.distiller import TapNorm, TapNorms
    from esamp.engines.vllm import settings as es
    from esamp.engines.vllm.exchange import exchange_for
    from esamp.engines.vllm.late import LateAdapter

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    rows = args.prompts * args.n
    if rows > args.max_rows:
        ap.error(f"{args.prompts} prompts of n={args.n} are {rows} rows, past --max-rows {args.max_rows}")
    H, V = args.hidden, args.vocab
    dtype = torch.bfloat16 if cuda else torch.float32
    config = _config(args, max(args.max_rows, rows))
    gen = torch.Generator(device=device).manual_seed(0)
    head = (torch.randn(V, H, device=device, generator=gen, dtype=torch.float32) * H**-0.5).to(dtype)
    weight = (0.5 + torch.rand(H, device=device, generator=gen)).to(dtype)
    norms = TapNorms(TapNorm(weight, 1e-6), TapNorm(weight.flip(0), 1e-6))
    aux = (torch.randn(rows, 2 * H, device=device, generator=gen) * 3).to(dtype)
    raw = torch.randn(rows, V, device=device, generator=gen) * 4  # the sampler's logits, fp32
    logits = torch.empty_like(raw)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    with torch.inference_mode():
        model = _TapModel(exchange_for(config), head, norms)
        prompt_len = np.zeros(config.scheduler_config.max_num_seqs, dtype=np.int32)
        adapter = LateAdapter(config, SimpleNamespace(device=device, prompt_len=SimpleNamespace(np=prompt_len)))
        model.compute_logits(aux, dtype)  # vLLM's start-up step: captures every graph before a request
        sync()
        steering = adapter.steering
        slots = list(range(rows))
        for slot in slots:
            params = _params(args.temperature, args.top_p, args.min_p, args.top_k)
            group, sample = f"g{slot // args.n}", slot % args.n
            es.prepare(params, settings=es.request_settings(group, sample, Steering(beta=args.beta)))
            prompt_len[slot] = 64
            adapter.add_request(slot, params)
        order = np.asarray(slots, dtype=np.intp)
        seq_lens = np.full(rows, 64, dtype=np.int32)
        ctx = SimpleNamespace(idx_mapping_np=order, seq_lens_upper_bound_np=seq_lens)

        def step(ctx) -> tuple[float, float, float, float]:
            logits.copy_(raw)
            ctx.seq_lens_upper_bound_np += 1
            if not args.no_sync:
                sync()
            w0, c0 = time.perf_counter(), time.thread_time()
            model.compute_logits(aux, dtype)
            w1, c1 = time.perf_counter(), time.thread_time()
            adapter.apply(logits, ctx)
            w2, c2 = time.perf_counter(), time.thread_time()
            return w1 - w0, c1 - c0, w2 - w1, c2 - c1

        for _ in range(args.warmup):
            step(ctx)
        steering.records.take()
        before = steering.metrics()
        timed = [step(ctx) for _ in range(args.steps)]
        after = steering.metrics()
        rebuilt = []
        for i in range(args.rebuilds):  # rows reordered: the adapter builds its plan again
            shuffled = SimpleNamespace(
                idx_mapping_np=np.roll(order, i + 1), seq_lens_upper_bound_np=np.roll(seq_lens, i + 1)
            )
            rebuilt.append(step(shuffled))
            seq_lens[:] = np.roll(shuffled.seq_lens_upper_bound_np, -(i + 1))
        step(ctx)  # back to the usual order
        pieces = _pieces(adapter, steering, lambda: step(ctx), args.steps)
        profiles = {}
        if args.profile:  # the steady steps, then as many with the rows reordered each step (plan rebuilds)
            for name, rolled in (("steady", False), ("rebuild", True)):
                profiler = cProfile.Profile()
                for i in range(args.profile):
                    here = ctx
                    if rolled:
                        here = SimpleNamespace(
                            idx_mapping_np=np.roll(order, i % (rows - 1) + 1), seq_lens_upper_bound_np=seq_lens
                        )
                    logits.copy_(raw)
                    seq_lens[:] += 1
                    sync()
                    profiler.enable()
                    model.compute_logits(aux, dtype)
                    adapter.apply(logits, here)
                    profiler.disable()
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.top)
                profiles[name] = out.getvalue()
        sync()
        left = len(steering.records.take()[0])

    steady = after["replay_steps"] - before["replay_steps"]
    split = {
        part: round((after[f"replay_{part}_ms"] - before[f"replay_{part}_ms"]) / max(steady, 1), 4)
        for part in ("distill", "mix", "records")
    }
    split["rest"] = round(
        (after["replay_host_ms"] - before["replay_host_ms"]) / max(steady, 1) - sum(split.values()), 4
    )
    report = dict(
        command="python benchmarks/host_micro.py " + " ".join(sys.argv[1:] if argv is None else argv),
        commit=provenance.commit(),
        device=provenance.device() if cuda else "cpu",
        versions=provenance.versions(),
        environment=provenance.environment(),  # (ESAMP_UPDATE=inline and the like choose the path measured)
        shape=dict(hidden=H, vocab=V, rows=rows, prompts=args.prompts, n=args.n, max_rows=args.max_rows),
        distiller=args.distiller,
        filters=dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p),
        steps=args.steps,
        steady_steps_counted=steady,
        apply_wall_ms=_summary([t[2] for t in timed]),
        apply_cpu_ms=_summary([t[3] for t in timed]),
        model_side_wall_ms=_summary([t[0] for t in timed]),
        model_side_cpu_ms=_summary([t[1] for t in timed]),
        split_per_steady_step_ms=split,
        rebuild_apply_wall_ms=_summary([t[2] for t in rebuilt]) if rebuilt else None,
        pieces_us_per_step=pieces,
        synced=not args.no_sync,
        records_read=left,
        counters={k: after.get(k) for k in ("padded_prepared", "graphs_prepared", "padded_graph_captures")},
        primitives_us=primitives(device) if args.primitives and cuda else None,
    )
    print(json.dumps({k: v for k, v in report.items() if k not in ("versions",)}, indent=1))
    for name, text in profiles.items():
        print(f"cProfile, {args.profile} {name} steps:\n{text}")
        report[f"profile_{name}"] = text.splitlines()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
