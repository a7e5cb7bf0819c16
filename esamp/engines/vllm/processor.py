"""``EsampLogitsProcessor``: ESamp inside vLLM's sampler, through the V1 logits-processor interface.

Per step, for every row whose request carries ESamp settings (``extra_args["esamp"]``, on):

1. ``distill`` (called by the model's ``compute_logits`` with this step's tapped rows, in
   logits-row order): predict the target from the source with the group's Distiller slot; the
   row error e is the raw novelty of the token that was this row's input; train one optimizer
   step per slot on the step's rows (the prediction used for steering is the one from before the
   update, as in the reference engine). The model then runs its LM head once on ``[h; ŷ]`` and
   hands back the Distiller logits d = W·ŷ (``take_distiller_logits``).
2. ``apply`` (vLLM's sampler): z̃ = z/T, then the request's own min-p, top-k and top-p on z̃ with
   vLLM's own filter code (``apply_top_k_top_p``: the Triton kernel on a GPU, the sort elsewhere),
   so C is exactly the set vLLM's sampler would keep; then z' = a·z̃ − b·d on C and −∞ elsewhere,
   with (a, b) = (1+β, β) for the paper mix and (1, β) for the unsharpened one
   (``esamp.intervention.mix``). The request handed vLLM neutral filters, so vLLM only draws
   from z'.

Nothing here reads a device value on the host: row mappings are host lists turned into device
tensors once per batch change, and every step is a fixed sequence of kernels. On a GPU the
Distiller step (forward, backward and optimizer: some seventy small kernels, bound by their
launches) is captured as a CUDA graph once a batch has stayed the same for ``GRAPH_AFTER``
steps, and replayed from then on: a few microseconds of launch instead of milliseconds
(``ESAMP_CUDA_GRAPHS=0`` turns this off). Graphs are kept per batch shape (slot of every row,
rows that train; ``GRAPH_CACHE`` of them), so a shape that comes back replays at once. The mix
and the candidate count are one fused pass (``kernels.mix_and_count``). Rows are mapped
fresh from ``BatchUpdate`` (removed → added → moved); state is keyed by group, never by row. A
group's slot is allocated when its first request joins and freed when the client releases the
group (``drain(release=...)``), so a preempted request that leaves the batch and comes back keeps
its group's Distiller.

Results leave through ``drain``: one record per step (rows with group, sample, generation
index and error; per-group loss and candidate counts; port hits). Device values are copied
without blocking and read only once their copy has finished, so draining never stalls the GPU.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from esamp.core import intervention as iv
from esamp.core.distiller import DistillerBank, RowLayout
from esamp.core.backends.triton_mix import mix_and_count
from esamp.engines.vllm.settings import KEY, parse_request_settings, vllm_filters
from esamp.engines.vllm.state import STATE

try:  # vLLM ≤ 0.30: the V1 interface (the MRv2 one of ≥ 0.31 would need a second adapter)
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
except ImportError as exc:  # pragma: no cover - depends on the installed vLLM
    raise ImportError(f"this vLLM has no V1 logits-processor interface: {exc}") from exc

try:  # the top-k/top-p filters vLLM's sampler runs (a drift canary checks them against the core's)
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p as vllm_top_k_top_p
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch as vllm_top_k_top_p_cpu
except ImportError:  # pragma: no cover - depends on the installed vLLM
    vllm_top_k_top_p = vllm_top_k_top_p_cpu = None


log = logging.getLogger(__name__)

# Eager Distiller steps on an unchanged batch before its step is captured as a CUDA graph: short
# lived batches (prefill, groups joining or leaving) are not worth a capture.
GRAPH_AFTER = 2
# Captured steps kept for batch shapes that come back (the same slots and rows, e.g. the next run
# of a benchmark or a steady serving mix); the least recently used goes first.
GRAPH_CACHE = 4


@dataclass
class _Row:
    settings: dict
    output_ids: list[int]  # live reference to the request's generated ids


@dataclass
class _StepRecord:
    step: int
    groups: list[str]  # per steered row (shared with the plan)
    samples: list[int]
    generated: list[int]  # generation index per row: tokens generated before this step
    errors: torch.Tensor  # [n] raw row error
    candidates: torch.Tensor  # [n] |C| per row
    loss_groups: list[str] = field(default_factory=list)
    losses: torch.Tensor | None = None  # [U] per-slot loss before the step's update
    event: object = None  # a CUDA event once the copies above are queued


@dataclass
class _Plan:
    """One batch shape's row → request mapping, on the device; rebuilt when the batch changes."""

    settings: list[dict]
    outputs: list[list[int]]
    groups: list[str]
    samples: list[int]
    idx: torch.Tensor | None  # logits rows steered, or None when that is every row in order
    temperature: torch.Tensor  # [n, 1], 1 for greedy rows (vLLM's sampler takes their argmax)
    min_p: torch.Tensor | None  # [n, 1]; None when no row uses min-p
    top_k: list[int]  # 0 = off
    top_p: torch.Tensor | None  # [n]; None when no row uses top-p
    a: torch.Tensor  # [n, 1] weight of z̃ in the mix
    neg_b: torch.Tensor  # [n, 1] −β
    layout: RowLayout
    train: tuple[torch.Tensor, RowLayout, list[str]] | None
    all_train: bool
    key: tuple  # (slot per row, rows that train): equal keys run the same Distiller step
    _k: tuple[int, torch.Tensor | None] | None = None

    def k(self, vocab: int, make) -> torch.Tensor | None:
        """top-k as vLLM's sampler passes it (vocab size for rows without top-k), or None."""
        if self._k is None or self._k[0] != vocab:
            self._k = (vocab, make([k if 0 < k < vocab else vocab for k in self.top_k], torch.long)
                       if any(0 < k < vocab for k in self.top_k) else None)
        return self._k[1]


@dataclass
class _Context:
    """What ``distill`` computed for this step, for ``apply`` to use."""

    plan: _Plan
    rows: int
    source: torch.Tensor
    target: torch.Tensor
    prediction: torch.Tensor
    errors: torch.Tensor
    losses: torch.Tensor | None
    replayed: bool = False  # the Distiller step was a CUDA-graph replay
    host_seconds: float = 0.0  # host time spent in ``distill``
    distiller_logits: torch.Tensor | None = None


class _GraphedStep:
    """One plan's Distiller step as a CUDA graph: static input rows in, static outputs back.

    Captured on a side stream into a private memory pool; nothing runs during the capture, so
    the bank's state is untouched until the first replay. The outputs are overwritten by the
    next replay, which stream order puts after every use of them in this step.
    """

    def __init__(self, plan: "_Plan", fn, x: torch.Tensor, y: torch.Tensor) -> None:
        self.plan = plan  # keeps the layout tensors the graph reads alive
        self.x, self.y = x.clone(), y.clone()
        self.graph = torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.out = fn(self.x, self.y)
            finally:
                self.graph.capture_end()
        main.wait_stream(side)

    def run(self, x: torch.Tensor, y: torch.Tensor):
        self.x.copy_(x)
        self.y.copy_(y)
        self.graph.replay()
        return self.out


def filter_candidates(scaled: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      min_p: torch.Tensor | None) -> torch.Tensor:
    """The request's own filters on z̃, in place (−∞ outside C), exactly as vLLM's sampler does.

    min-p with the formula of vLLM's built-in min-p processor, then the top-k/top-p function
    vLLM's sampler calls on this device (on a GPU the Triton kernel from 8 rows up, the sort below
    that; on a CPU the sort). Without those functions (a vLLM that moved them) the core's filter,
    which a canary test holds equal to them.
    """
    if vllm_top_k_top_p is None:
        R, V = scaled.shape
        mask = iv.candidate_mask(
            scaled, top_k if top_k is not None else torch.zeros(R, dtype=torch.long),
            top_p if top_p is not None else torch.ones(R),
            min_p.reshape(-1) if min_p is not None else torch.zeros(R), width=V)
        return scaled.masked_fill_(~mask, iv.NEG_INF)
    if min_p is not None:
        probs = scaled.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True).mul_(min_p)
        scaled.masked_fill_(probs < floor, iv.NEG_INF)
    if top_k is not None or top_p is not None:
        if scaled.is_cuda:
            scaled = vllm_top_k_top_p(scaled, top_k, top_p)
        else:
            scaled = vllm_top_k_top_p_cpu(scaled, top_k, top_p, allow_cpu_sync=True)
    return scaled


class EsampLogitsProcessor(LogitsProcessor):
    """Applies ESamp to the rows of requests that carry ``extra_args["esamp"]``."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.pin = bool(is_pin_memory) and self.device.type == "cuda"
        extra = getattr(vllm_config, "additional_config", None) or {}
        self.settings = extra.get(KEY) if isinstance(extra, dict) else None
        self.bank: DistillerBank | None = None
        if self.settings is not None:
            hidden = int(vllm_config.model_config.get_hidden_size())
            with torch.inference_mode(False):
                self.bank = DistillerBank(
                    hidden, rank=self.settings["rank"], slots=self.settings["slots"],
                    lr=self.settings["lr"], optimizer=self.settings["optimizer"],
                    device=self.device, seed=self.settings["seed"],
                )
        self.rows: dict[int, _Row] = {}
        self.live: collections.Counter[str] = collections.Counter()  # group → rows in batch
        self.records: collections.deque[_StepRecord] = collections.deque()
        self.step = 0
        self.counters = collections.Counter()
        self.host_seconds = 0.0  # time spent in distill + apply on the host (launching work)
        self.replay_seconds = 0.0  # the same, over steps whose Distiller step was a graph replay
        self.trace: list[dict] | None = None  # tests set a list to see every steered step
        self._cached_plan: _Plan | None = None
        self._cached_plan_rows = -1
        self._ctx: _Context | None = None
        self.use_graphs = self.device.type == "cuda" and os.environ.get("ESAMP_CUDA_GRAPHS", "1") != "0"
        self._graphs: collections.OrderedDict[tuple, _GraphedStep] = collections.OrderedDict()
        self._graph_plan: _Plan | None = None
        self._graph_seen = 0
        STATE.set_processor(self)

    # -- the interface -----------------------------------------------------------------------

    @classmethod
    def validate_params(cls, params) -> None:
        settings = parse_request_settings(params.extra_args)
        if settings is None or not settings["on"]:
            return
        if params.n != 1:
            raise ValueError("ESamp requests must have n=1: fan samples out as requests of one group")
        neutral = vllm_filters(True, _SamplingView(settings))
        got = dict(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                   min_p=params.min_p)
        if any(abs(float(got[k] or 0) - float(v)) > 1e-9 for k, v in neutral.items()
               if not (k == "top_k" and (got[k] or 0) <= 0 and v == 0)):
            raise ValueError(
                f"an ESamp request must hand vLLM neutral filters {neutral} and carry its real "
                f"ones in extra_args['esamp'], got {got}"
            )
        if (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                or params.frequency_penalty != 0.0):
            raise ValueError("ESamp requests do not support penalties (they would act after steering)")

    def is_argmax_invariant(self) -> bool:
        return False  # ESamp moves the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self._cached_plan = None
        for index in batch_update.removed:
            self._drop(index)
        for index, params, _prompt, output_ids in batch_update.added:
            self._drop(index)
            settings = parse_request_settings(getattr(params, "extra_args", None))
            if settings is None or not settings["on"] or self.bank is None:
                continue
            group = settings["group"]
            if group not in self.bank.groups:
                if self.bank.free_slots == 0:
                    self.counters["bank_full"] += 1
                    continue
                self.bank.allocate(group)
            self.rows[index] = _Row(settings, output_ids)
            self.live[group] += 1
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if direction == MoveDirectionality.SWAP and rb is not None:
                self.rows[a] = rb
            elif rb is not None:  # a one-way move overwrote b
                self._forget(rb)

    def _drop(self, index: int) -> None:
        row = self.rows.pop(index, None)
        if row is not None:
            self._forget(row)

    def _forget(self, row: _Row) -> None:
        group = row.settings["group"]
        self.live[group] -= 1
        if self.live[group] <= 0:
            del self.live[group]

    def release(self, group: str) -> None:
        """The client is done with ``group``: drop its rows and free its slot now.

        Only the client knows a group is over: a request can leave the batch and come back
        (preemption), and a finished request is removed from the batch only at the next step.
        """
        for index in [i for i, r in self.rows.items() if r.settings["group"] == group]:
            self._drop(index)
            self._cached_plan = None
        if self.bank is not None and group in self.bank.groups:
            self.bank.free(group)
            self.counters["slots_freed"] += 1

    def distill(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        """This step's Distiller work on the tapped rows [R, H]; returns ŷ for the rows it steers.

        Called by the model's ``compute_logits`` (after ``update_state``, before ``apply``).
        None when no row of this step is steered.
        """
        self._ctx = None
        if not self.rows or self.bank is None:
            return None
        t0 = time.perf_counter()
        plan = self._plan(source.shape[0])
        if plan is None:
            return None
        x = source if plan.idx is None else source.index_select(0, plan.idx)
        y = target if plan.idx is None else target.index_select(0, plan.idx)
        replay = self.use_graphs and plan.key in self._graphs
        prediction, errors, losses = self._distiller(plan, x, y)
        self._ctx = _Context(plan, source.shape[0], x, y, prediction, errors, losses, replayed=replay)
        self._ctx.host_seconds = time.perf_counter() - t0
        self.host_seconds += self._ctx.host_seconds
        return prediction

    def _distiller_step(self, plan: _Plan, x: torch.Tensor, y: torch.Tensor):
        """(ŷ, e, per-slot loss or None) for the plan's rows, training the slots that train."""
        if plan.all_train:  # one forward pass gives the (pre-update) prediction and the step
            return self.bank.predict_and_train(x, y, plan.layout)
        prediction = self.bank.predict(x, plan.layout)
        errors = DistillerBank.row_error(prediction, y)
        losses = None
        if plan.train is not None:
            t, layout, _ = plan.train
            losses = self.bank.train_step(x.index_select(0, t), y.index_select(0, t), layout)
        return prediction, errors, losses

    def _distiller(self, plan: _Plan, x: torch.Tensor, y: torch.Tensor):
        """The Distiller step, eager or by replaying the plan's CUDA graph (see ``GRAPH_AFTER``)."""
        if not self.use_graphs:
            return self._distiller_step(plan, x, y)
        graph = self._graphs.get(plan.key)
        if graph is not None:  # captured for this plan or an earlier one of the same shape
            self._graphs.move_to_end(plan.key)
            return graph.run(x, y)
        if self._graph_plan is not plan:
            self._graph_plan, self._graph_seen = plan, 0
        self._graph_seen += 1
        if self._graph_seen <= GRAPH_AFTER:
            return self._distiller_step(plan, x, y)
        while len(self._graphs) >= GRAPH_CACHE:  # the least recently used graph and its memory go
            self._graphs.popitem(last=False)
        try:
            with torch.inference_mode(False):
                graph = _GraphedStep(plan, lambda gx, gy: self._distiller_step(plan, gx, gy), x, y)
        except Exception as exc:  # never let an optimisation take the engine down
            self.use_graphs = False
            self._graphs.clear()
            self.counters["graph_failures"] += 1
            log.warning("ESamp: capturing the Distiller step as a CUDA graph failed (%s); "
                        "continuing without graphs", exc)
            return self._distiller_step(plan, x, y)
        self._graphs[plan.key] = graph
        self.counters["graph_captures"] += 1
        return graph.run(x, y)

    def take_distiller_logits(self, d: torch.Tensor) -> None:
        """d = W·ŷ [n, V] for this step's steered rows (plan order), from the model's LM head."""
        if self._ctx is not None:
            self._ctx.distiller_logits = d

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        ctx, self._ctx = self._ctx, None
        if not self.rows or self.bank is None:
            return logits
        t0 = time.perf_counter()
        R, V = logits.shape
        plan = self._plan(R)
        if plan is None:
            return logits
        self.step += 1
        z = logits if plan.idx is None else logits.index_select(0, plan.idx)
        raw = z.clone() if self.trace is not None else None
        # z̃ = z / T and the request's own filters, in place (z is the sampler's fp32 copy or ours)
        scaled = filter_candidates(z.div_(plan.temperature), plan.k(V, self._tensor), plan.top_p, plan.min_p)
        if ctx is None or ctx.plan is not plan or ctx.rows != R or ctx.distiller_logits is None:
            # No taps for this step (should not happen): the request's own filters stay exact,
            # but nothing is steered or trained; the counters say so.
            if plan.idx is not None:
                logits.index_copy_(0, plan.idx, scaled)
            self.counters["stash_miss"] += 1
            self.host_seconds += time.perf_counter() - t0
            return logits
        # z' = a·z̃ − b·d on C; −∞ stays −∞ outside C (d is finite); |C| per row on the way
        out, candidates = mix_and_count(scaled, ctx.distiller_logits, plan.a, plan.neg_b)
        if plan.idx is not None:
            logits.index_copy_(0, plan.idx, out)
        self.counters["port_hits"] += len(plan.settings)
        record = _StepRecord(step=self.step, groups=plan.groups, samples=plan.samples,
                             generated=[len(o) for o in plan.outputs], errors=ctx.errors,
                             candidates=candidates)
        if plan.train is not None:
            record.losses, record.loss_groups = ctx.losses, plan.train[2]
            self.counters["train_steps"] += 1
        if self.trace is not None:
            self.trace.append(dict(
                meta=list(zip(record.groups, record.samples, record.generated)), settings=plan.settings,
                logits=raw, source=ctx.source.clone(), target=ctx.target.clone(),
                prediction=ctx.prediction.clone(), distiller_logits=ctx.distiller_logits.clone(),
                steered=out.clone()))
        self._queue(record)
        spent = time.perf_counter() - t0
        self.host_seconds += spent
        if ctx.replayed:  # a steady step: what ESamp costs the host per step once warmed up
            self.replay_seconds += spent + ctx.host_seconds
            self.counters["replay_steps"] += 1
        return logits

    def _plan(self, R: int) -> "_Plan | None":
        """This step's row → request mapping on the device, rebuilt only when the batch changed.

        Decode steps with an unchanged batch reuse the device tensors, so a steady step makes no
        host→device copy at all.
        """
        if self._cached_plan is not None and self._cached_plan_rows == R:
            return self._cached_plan
        steered = sorted(((i, r) for i, r in self.rows.items() if i < R), key=lambda t: t[0])
        if not steered:
            self._cached_plan, self._cached_plan_rows = None, R
            return None
        rows = [r.settings for _, r in steered]
        slots = [self.bank.slot_of(s["group"]) for s in rows]
        train = [j for j, s in enumerate(rows) if s["train"]]
        order = [i for i, _ in steered]
        with torch.inference_mode(False):
            plan = _Plan(
                settings=rows,
                outputs=[r.output_ids for _, r in steered],
                groups=[s["group"] for s in rows],
                samples=[s["sample"] for s in rows],
                idx=None if order == list(range(R)) else self._tensor(order, torch.long),
                temperature=self._tensor([[s["temperature"] if s["temperature"] > 0 else 1.0] for s in rows]),
                min_p=self._tensor([[s["min_p"]] for s in rows]) if any(s["min_p"] > 0 for s in rows) else None,
                top_k=[s["top_k"] for s in rows],
                top_p=self._tensor([s["top_p"] for s in rows]) if any(s["top_p"] < 1 for s in rows) else None,
                a=self._tensor([[1.0 + s["beta"] if s["mix"] == "paper" else 1.0] for s in rows]),
                neg_b=self._tensor([[-s["beta"]] for s in rows]),
                layout=self._layout(slots),
                train=(self._tensor(train, torch.long), self._layout([slots[j] for j in train]),
                       list(dict.fromkeys(rows[j]["group"] for j in train))) if train else None,
                all_train=len(train) == len(rows),
                key=(tuple(slots), tuple(train)),
            )
        self._cached_plan, self._cached_plan_rows = plan, R
        return plan

    # -- results -----------------------------------------------------------------------------

    def _queue(self, record: _StepRecord) -> None:
        """Start the record's device→host copy without waiting for it: one copy of the errors,
        candidate counts (exact in fp32: a vocabulary is far below 2²⁴) and losses, packed."""
        nb = self.device.type == "cuda"
        n = record.errors.shape[0]
        parts = [record.errors.float(), record.candidates.float()]
        if record.losses is not None:
            parts.append(record.losses.float())
        packed = torch.cat(parts).to("cpu", non_blocking=nb)
        record.errors, record.candidates = packed[:n], packed[n:2 * n]
        if record.losses is not None:
            record.losses = packed[2 * n:]
        if nb:
            record.event = torch.cuda.Event()
            record.event.record()
        self.records.append(record)

    def drain(self, release: list[str] | tuple[str, ...] = ()) -> dict:
        """Finished step records and counters, and release the client's finished groups."""
        for group in release:
            self.release(group)
        steps = []
        while self.records and (self.records[0].event is None or self.records[0].event.query()):
            r = self.records.popleft()
            steps.append({
                "step": r.step,
                "rows": list(zip(r.groups, r.samples, r.generated, r.errors.tolist(),
                                 map(int, r.candidates.tolist()))),
                "loss": dict(zip(r.loss_groups, r.losses.tolist())) if r.losses is not None else {},
            })
        return {
            "steps": steps,
            "pending": len(self.records),  # steps whose device copies are still running
            "counters": dict(self.counters, host_ms=round(1e3 * self.host_seconds, 1),
                             replay_host_ms=round(1e3 * self.replay_seconds, 1)),
            "free_slots": self.bank.free_slots if self.bank is not None else 0,
            "groups": sorted(self.bank.groups) if self.bank is not None else [],
        }

    # -- helpers -----------------------------------------------------------------------------

    def _tensor(self, values, dtype=torch.float32) -> torch.Tensor:
        """A small host list on the device, without a blocking copy."""
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cpu":
            return t
        if self.pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=self.pin)

    def _layout(self, slots: list[int]) -> RowLayout:
        host = RowLayout.from_slots(slots, "cpu")
        if self.device.type == "cpu":
            return host
        return RowLayout(self._tensor(host.active.tolist(), torch.long),
                         self._tensor(host.row_slot.tolist(), torch.long),
                         self._tensor(host.row_pos.tolist(), torch.long), host.width, host.slots)


class _SamplingView:
    """The fields of ``SamplingConfig`` that ``vllm_filters`` reads, from request settings."""

    def __init__(self, settings: dict) -> None:
        self.temperature = settings["temperature"]
        self.top_p, self.top_k, self.min_p = settings["top_p"], settings["top_k"], settings["min_p"]
