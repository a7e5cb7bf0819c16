"""``EngineSteering``: ESamp inside one vLLM engine, whichever logits-processor adapter feeds it.

It owns the engine's Distiller bank and the core ``Steerer``, builds a ``BatchPlan`` from the
adapter's rows when the batch changes, runs the Distiller step on the rows the model tapped
(``distill``), filters and mixes the sampler's logits (``apply``), keeps step records and
counters, and frees groups. The model and the adapter meet through ``esamp.engines.vllm.exchange``.

With the shared Distiller (``distiller="shared"``) every group holds the bank's one slot, so a
step's steered rows are one unit of the Distiller block (as wide as the batch) and its loss, the
mean over every training row, is reported for each group that trained in the step.

Under tensor parallelism (``esamp.engines.vllm.tp``) only TP rank 0 owns the bank and keeps
records; it broadcasts ŷ inside ``distill``. Every other worker keeps a ``SlotLedger`` in the
bank's place (the same slots for the same groups, so the same plans), receives ŷ instead of
running the Distiller step, and filters and mixes exactly as rank 0 does.

Speed: nothing here reads a device value on the host. A plan's tensors are views of fixed
buffers (``PlanBuffers``) and its Distiller block is padded to bucketed shapes, so the Distiller
step is one CUDA-graph replay per step whatever groups hold whatever slots; the graphs of the
usual shapes are captured before the first request (``prepare``). The filter and mix are a second
replay, in place on the sampler's logits. A new group costs a plan rebuild (host lists and two
small copies), not a capture.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from esamp.core.backends.graphs import GraphCache, PriorityLane, SideStream
from esamp.core.backends.triton_filter import LogitsAt, few_candidates
from esamp.core.config import EsampConfig, SamplingConfig, Steering, bound
from esamp.core.distiller import DistillerBank, SlotLedger, bank_for, ledger_for
from esamp.core.intervention import HeadProduct
from esamp.core.steerer import FUSED_FILTER, PlanBuffers, SteeredRow, Steerer, StepPlan, bucket, reference_filter
from esamp.engines.vllm import hooks, settings as es
from esamp.engines.vllm.rows import Groups, RequestRow
from esamp.engines.vllm.step_records import RETAIN_SECONDS, RecordStore
from esamp.engines.vllm.tp import ALONE, TensorParallel, tensor_parallel

DISTILL_GRAPHS = 64  # captured Distiller shapes kept (every bucketed shape of a 256-row batch is 39)
# Captured filter-and-mix steps kept. A key names the sampler's logits buffer and the plan's shape,
# so a run through several batch shapes holds more than a few: esamp bench's three workloads on
# MRV2 captured 26 with 4 kept (vLLM 0.33, one H200), each capture on a step's path. They share
# one memory pool (below), so more kept graphs cost no more device memory than the largest.
APPLY_GRAPHS = 16
PADDED_GRAPHS = 64  # ≥ every padded step's key: 9 buckets of rows × top-p or not × three forms of d at 256 rows
# A late adapter's steady step as one graph (``step_late``): the Distiller step, its update in line
# (ESAMP_UPDATE=inline) and the padded filter and mix. ESAMP_STEP=split keeps them two graphs.
FUSED_STEP = os.environ.get("ESAMP_STEP", "one-graph") != "split"
# Where the Distiller's update runs on a GPU (ESAMP_UPDATE): "auto" (the default), in line for
# Distiller blocks of up to AUTO_INLINE_CELLS cells and beside above; "beside" the steps that follow,
# on a stream of its own; "inline", in the Distiller step's own graph (on MRV2 the steady step is
# then one graph). Measured on one H100 (benchmarks/results/bench-7b-mrv2-vllm033-95c920a-*): auto
# 0.975 of vanilla on 16x64 against beside's 0.960, the same on fair and 32xn8x256.
UPDATE_WAYS = ("auto", "beside", "inline")
AUTO_INLINE_CELLS = 128


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    """Environment variable ``name``, one of ``choices`` (unset: the first); a clear error for any other value."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        raise ValueError(
            f"{name} must be one of {', '.join(choices)}, not {value!r}: unset it for the default ({choices[0]})"
        )
    return value


def update_way() -> str:
    """ESAMP_UPDATE's way of the Distiller's update."""
    return _env_choice("ESAMP_UPDATE", UPDATE_WAYS)


# Where the filter and mix of a step whose update runs beside it replays (ESAMP_MIX_STREAM): on a
# stream of the device's highest priority ("priority", the default: ``PriorityLane``), so that its
# kernels do not wait behind the update's blocks, or on the "current" stream. Measured on one H100
# (the 16x64 step trace, benchmarks/results/steps-7b-16x64-95c920a-h100/): a step 30 µs shorter.
MIX_STREAMS = ("priority", "current")


def mix_stream() -> str:
    """ESAMP_MIX_STREAM's stream of the filter and mix."""
    return _env_choice("ESAMP_MIX_STREAM", MIX_STREAMS)


QUIET = Steering(enabled=False, beta=0.0)  # a row only filtered (never changed: a plan holds it)
EXPIRE_EVERY = 1.0  # seconds between checks for records nobody read
# A step whose host time passes SLOW_STEP_S is kept, with where its time went, among the last
# SLOW_STEPS_KEPT such steps (``metrics()["slow_steps"]``): what a steady step's mean hides.
SLOW_STEP_S = 0.002
SLOW_STEPS_KEPT = 32
# Counters operators read (``metrics``), all present from the start: a reader on another thread
# copies the dict while the engine counts, which is safe only while it never grows.
COUNTERS = (
    "port_hits",
    "train_steps",
    "replay_steps",
    "rebuild_steps",
    "plan_builds",
    "taps_missing",
    "bank_full",
    "slots_evicted",
    "slots_released",
    "slots_freed",
    "graphs_prepared",
    "padded_prepared",
    "prepare_ms",
    "logits_moved",  # padded steps whose logits were elsewhere than the step before's (one small write each)
)


@dataclass
class BatchPlan:
    """One batch: which logits rows are steered (first in ``step``) or only filtered, and who they are."""

    rows: int  # logits rows of the step
    step: StepPlan
    members: list[RequestRow]  # the steered rows, in plan order
    member_rows: list[int]  # per steered row, its logits row
    groups: list[str]  # per steered row (what its records say)
    samples: list[int]
    outputs: list  # per steered row, its request's live list of generated ids (its length: the row's position)
    unit_groups: list[tuple[str, ...]]  # per Distiller unit, the groups whose loss it is (none: no training)
    recorded: set[str] | None  # groups whose records are kept (None: every group's)
    few_candidates: bool = True  # every steered row's filters bound its candidates: d at the candidates
    padded: tuple | None = None  # its padded step's graph key, call and inputs' addresses (``_padded_step``)
    fused: tuple | None = None  # its one-graph step's key, call and what it reads (``_fused_step``)

    @property
    def steered(self) -> int:
        return self.step.steered


@dataclass
class Handoff:
    """What the model's ``compute_logits`` produced for ``apply`` in the same step."""

    plan: BatchPlan
    prediction: torch.Tensor  # ŷ per block cell (the plan's rows first), in the LM head's dtype
    errors: torch.Tensor | None  # e per block cell (None: a worker without the bank)
    losses: torch.Tensor | None  # per Distiller unit
    replayed: bool  # the Distiller step was a graph replay
    host_seconds: float
    # [steered, V] Distiller logits from the LM head, or ŷ and the head's weight (d at the candidates)
    d: torch.Tensor | HeadProduct | None = field(default=None)
    # Set where one graph ran the Distiller step and the padded filter and mix (``_fused_step``):
    # how many record values the step staged, and whether that graph was replayed, captured or run eagerly
    staged: int | None = None
    mixed: str | None = None


try:  # the top-k/top-p functions vLLM's sampler calls (a drift canary holds them to the core's)
    from vllm.v1.sample.ops.topk_topp_sampler import (
        apply_top_k_top_p as vllm_top_k_top_p,
        apply_top_k_top_p_pytorch as vllm_top_k_top_p_cpu,
    )
except ImportError:  # pragma: no cover - depends on the installed vLLM
    vllm_top_k_top_p = vllm_top_k_top_p_cpu = None


def _addresses(d: torch.Tensor | HeadProduct) -> tuple[int, ...]:
    """Where a captured filter-and-mix reads ``d`` (its graph's key)."""
    if isinstance(d, HeadProduct):
        return (d.prediction.data_ptr(), d.prediction.stride(0), d.head.data_ptr(), d.head.stride(0))
    return (d.data_ptr(), d.stride(0))


def vllm_filter(scaled: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """The request's own filters on z̃ for plans with top-k, as vLLM's sampler applies them: min-p
    in logit space, then the top-k/top-p function vLLM's sampler calls on this device (its Triton
    kernel on a GPU, the sort on a CPU); the core's filter where vLLM moved those functions."""
    if vllm_top_k_top_p is None:
        return reference_filter(scaled, plan)
    floor = scaled.amax(dim=-1, keepdim=True) + plan.min_p.reshape(-1, 1).clamp(min=1e-38).log()
    scaled.masked_fill_((scaled < floor) & (plan.min_p.reshape(-1, 1) > 0), float("-inf"))
    k = None
    if plan.top_k is not None:
        k = torch.where(plan.top_k > 0, plan.top_k, torch.full_like(plan.top_k, scaled.shape[1]))
    p = plan.top_p
    if scaled.is_cuda:
        return vllm_top_k_top_p(scaled, k, p)
    return vllm_top_k_top_p_cpu(scaled, k, p, allow_cpu_sync=True)


class EngineSteering:
    """ESamp in one engine (``config`` None: an engine without ESamp, whose ESamp-prepared
    requests are filtered but never steered), on one worker of its tensor-parallel group (``tp``)."""

    def __init__(
        self,
        config: EsampConfig | None,
        *,
        hidden: int,
        vocab: int,
        max_rows: int,
        device: torch.device,
        record_all: bool = True,
        retain_seconds: float | None = None,
        tp: TensorParallel = ALONE,
    ) -> None:
        self.config, self.hidden, self.vocab, self.tp = config, hidden, vocab, tp
        self.device = torch.device(device)
        self.max_rows = max_rows
        self.record_all = record_all
        self.step_no = 0
        self.counters: collections.Counter = collections.Counter(dict.fromkeys(COUNTERS, 0))
        self.host_seconds = self.replay_seconds = self.plan_seconds = self.rebuild_seconds = 0.0
        self.replay_cpu_seconds = 0.0  # of the steady steps' host time, the thread's CPU time (late adapters)
        self.replay_split = [0.0, 0.0, 0.0]  # of replay_seconds: Distiller step, filter and mix, record
        self._plan_spent = 0.0  # host time of the plan built for the coming ``apply`` (0: none)
        self._plan_parts = [0.0, 0.0, 0.0, 0.0]  # of it: the rows, the build, the buffers' copy, CPU time
        self._steered_rows: dict[int, tuple] = {}  # id(request row) → (it, (slot, complete), its SteeredRow)
        self.slow_steps: collections.deque[dict] = collections.deque(maxlen=SLOW_STEPS_KEPT)
        self._born = time.monotonic()
        graphs = self.device.type == "cuda" and os.environ.get("ESAMP_CUDA_GRAPHS", "1") != "0"
        bank = None
        self.slots: SlotLedger | None = None  # the bank's slots, or a ledger of them (a worker without it)
        if config is not None and not tp.owner:
            self.slots = ledger_for(config)
        elif config is not None:
            with torch.inference_mode(False):
                bank = bank_for(config, hidden, self.device)
            self.slots = bank
        way, lane = update_way(), mix_stream()
        self.ways = dict(update_way=way, mix_stream=lane)  # as configured, for ``metrics`` (a bench's JSON)
        self.steerer = (
            Steerer(
                bank,
                filter=vllm_filter,
                graphs=GraphCache(
                    enabled=graphs and bank is not None, after=0, size=DISTILL_GRAPHS, in_place=True, shared_pool=True
                ),
                # On a GPU the Distiller's update runs beside the steps that follow it, or in line
                # (``update_way``: one replay a step and no stream ordering on the host, the update's
                # kernels on the step's path), or in line for small blocks only ("auto").
                beside=SideStream(GraphCache(enabled=graphs, after=0, size=DISTILL_GRAPHS, in_place=True))
                if self.device.type == "cuda" and way != "inline"
                else None,
                inline_cells=AUTO_INLINE_CELLS if way == "auto" else 0,
            )
            if bank is not None
            else Steerer(None, filter=vllm_filter)
        )
        # One pool for the filter-and-mix graphs, which hold [rows, vocab] temporaries (335 MB each
        # for Gemma's 262k vocabulary at 320 rows): with a pool per graph, Gemma 3 270M's eval ran
        # out of memory above vLLM's share while capturing them. One pool costs the largest
        # graph's, not the sum. Safe: they replay one after another on one stream, and a step's
        # output (its record values) is copied out before the next replay.
        self.apply_graphs = GraphCache(enabled=graphs, after=1, size=APPLY_GRAPHS, in_place=True, shared_pool=True)
        # The padded steps' graphs (``_padded_step``): one per bucket of rows and form, every one the
        # engine may need captured before its first request (``prepare``), none evicted.
        self.padded_graphs = GraphCache(enabled=graphs, after=1, size=PADDED_GRAPHS, in_place=True, shared_pool=True)
        # Where a padded step replays while its plan's update runs beside it (``mix_stream``; None:
        # on the current stream)
        self.mix_lane = PriorityLane() if graphs and lane == "priority" and self.steerer.beside is not None else None
        # A late adapter's steps as one graph each, per Distiller shape and padded step
        # (``_fused_step``), captured on a step's path at a plan's third step, kept like the padded ones
        self.fused_graphs = GraphCache(
            enabled=graphs and FUSED_STEP, after=1, size=PADDED_GRAPHS, in_place=True, shared_pool=True
        )
        self._address = torch.zeros(1, dtype=torch.long, device=self.device)  # the logits' address, for them
        self._logits_address: int | None = None  # what ``_address`` holds
        self._logits_ats: dict[tuple[int, int], LogitsAt] = {}
        self.row_bucket = bucket(max_rows)  # the largest padded step's rows
        self.steerer.reserve(self.row_bucket, vocab, self.device)
        if self.slots is not None and self.slots.shared:  # one unit: every steered row of the batch
            units, width = 1, bucket(max_rows)
        else:  # a unit per group, as wide as a group's samples
            units = bucket(min(config.slots if config else 1, max_rows))
            width = bucket(min(bound(SamplingConfig, "n", "le"), max_rows))
        self.buffers = PlanBuffers(
            max_rows, units=units, width=width, device=self.device, scratch=self.slots.scratch if self.slots else 0
        )
        if bank is not None:  # the fused step's workspace, sized before any step is captured (the padded
            bank.reserve(self.row_bucket + 1, self.buffers.cells)  # steps read its outputs over a bucket)
        self.groups = Groups(self.slots)
        # A record ring row holds the longest packed step: a padded step's bucket of errors and
        # counts and every unit's loss (``_padded_fn``); a plan's own rows are never more.
        self.records = RecordStore(
            self.device,
            RETAIN_SECONDS if retain_seconds is None else retain_seconds,
            width=2 * self.row_bucket + self.buffers.units,
        )
        self._taps: torch.Tensor | None = None  # [max_rows + 1, A·H] tapped rows (last row zero)
        self._tap_views: tuple | None = None  # (what they view, (x, y)) of ``_views``
        self._shared: torch.Tensor | None = None  # [max_rows, H] ŷ received from TP rank 0
        self._prepared = False
        self._last_expire = time.monotonic()
        self.forget_rows = None  # weak method of the live adapter: drops a released group's rows
        self.records_server = None  # the library engine's records channel (``records_channel``), once asked

    @property
    def bank(self) -> DistillerBank | None:
        return self.steerer.bank

    # -- plans -------------------------------------------------------------------------------

    def plan(self, rows: dict[int, RequestRow], n_logits: int) -> BatchPlan:
        """The plan of a batch whose ESamp rows are ``rows`` (logits row → request row)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        step = self.step_no
        self.groups.live = {r.group for r in rows.values()}
        steered, plain = [], []
        slot_of: dict[str, int | None] = {}  # a group's slot, asked for once a plan
        for index in sorted(i for i in rows if i < n_logits):
            row = rows[index]
            slot = None
            if row.steering is not None and row.steering.enabled and self.slots is not None:
                if row.group not in slot_of:
                    slot_of[row.group] = self.groups.slot(row.group, step, self.counters)
                elif slot_of[row.group] is None:
                    self.counters["bank_full"] += 1  # (counted per row, as the first row's was)
                slot = slot_of[row.group]
            (steered if slot is not None else plain).append((index, row, slot))
        self.counters["slots_released"] += self.groups.release_idle(step)
        for _, row, _ in steered:
            self.groups.arrived(row)
        # Each row's SteeredRow, the same object while its request, slot and completeness stay (the
        # plan's numbers are worked out once per such object: ``StepPlan.build``)
        known, kept = self._steered_rows, {}
        spec = []
        for _, r, s in steered:
            complete = self.groups.complete(r)
            hit = known.get(id(r))
            if hit is None or hit[0] is not r or hit[1] != (s, complete):
                hit = (r, (s, complete), SteeredRow(s, r.steering, r.filters, complete, r.group))
            kept[id(r)] = hit
            spec.append(hit[2])
        for _, r, _ in plain:
            hit = known.get(id(r))
            if hit is None or hit[0] is not r or hit[1] is not None:
                hit = (r, None, SteeredRow(-1, QUIET, r.filters))
            kept[id(r)] = hit
            spec.append(hit[2])
        self._steered_rows = kept  # (this plan's rows only: a finished request's objects may go)
        index = [i for i, _, _ in steered] + [i for i, _, _ in plain]
        t_build = time.perf_counter()
        with torch.inference_mode(False):
            plan = StepPlan.build(spec, self.device, steered=len(steered), index=index, buffers=self.buffers)
        t_built = time.perf_counter()
        members = [r for _, r, _ in steered]
        unit_groups: list[tuple[str, ...]] = []
        if plan.layout is not None:
            unit_of = {s: u for u, s in enumerate(plan.layout.slots)}
            owners: list[dict[str, None]] = [{} for _ in range(plan.layout.shape[0])]  # ordered sets
            for (_, r, s), trains in zip(steered, plan.trains):
                if trains:
                    owners[unit_of[s]][r.group] = None
            unit_groups = [tuple(o) for o in owners]
        out = BatchPlan(
            rows=n_logits,
            step=plan,
            members=members,
            member_rows=[i for i, _, _ in steered],
            groups=[r.group for r in members],
            samples=[r.sample for r in members],
            outputs=[r.output_ids for r in members],
            unit_groups=unit_groups,
            recorded=None if self.record_all else {r.group for r in members if r.records},
            few_candidates=all(few_candidates(r.filters.min_p, r.filters.top_k) for r in members),
        )
        self.counters["plan_builds"] += 1
        spent = time.perf_counter() - t0
        self.plan_seconds += spent
        self._plan_spent += spent
        # where a rebuild's time went, for a slow step's entry: the rows, the plan's numbers and
        # block (of it, the copy of the buffers to the device), the rest; and its thread CPU time
        parts = self._plan_parts
        parts[0] += t_build - t0
        parts[1] += t_built - t_build
        parts[2] += self.buffers.write_seconds
        parts[3] += time.thread_time() - c0
        return out

    # -- the step ----------------------------------------------------------------------------

    def _tap_buffer(self, like: torch.Tensor) -> torch.Tensor:
        if self._taps is None or self._taps.shape[1] != like.shape[1] or self._taps.dtype != like.dtype:
            with torch.inference_mode(False):
                self._taps = torch.zeros(self.max_rows + 1, like.shape[1], dtype=like.dtype, device=like.device)
        return self._taps

    def _views(self, taps: torch.Tensor, source: int, target: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (taps.data_ptr(), taps.shape, source, target)
        if self._tap_views is None or self._tap_views[0] != key:  # the same two views every step
            H = self.hidden
            self._tap_views = (key, (taps[:, source * H : (source + 1) * H], taps[:, target * H : (target + 1) * H]))
        return self._tap_views[1]

    @property
    def unprepared(self) -> bool:
        """Whether ``prepare`` has work left (on a GPU, before its first call outside a capture)."""
        return not self._prepared and self.device.type == "cuda"

    def prepare(
        self,
        aux: torch.Tensor,
        source: int,
        target: int,
        normalize,
        head_dtype: torch.dtype,
        head: torch.Tensor | None = None,
    ) -> None:
        """Before any request: capture the Distiller step of every bucketed shape up to the batch's
        rows, compile the filter's kernels, and capture the padded filter-and-mix step of every
        bucket of rows (``aux``: any [rows, A·H] tap columns, for their width and dtype; ``head``:
        the model's dense [V, H] LM head, where it has one)."""
        if self._prepared or self.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        t0 = time.perf_counter()
        if self.bank is None:  # a tensor-parallel worker without the bank: only the filter to warm
            self._prepared = True
            self.steerer.warm_filter(self.vocab, self.device, head_dtype, self.hidden)
            self.counters["padded_prepared"] = self._prepare_padded(head, head_dtype)
            self.counters["prepare_ms"] = round(1e3 * (time.perf_counter() - t0), 1)
            return
        self._prepared = True  # (without graphs there is nothing to capture: no later step asks again)
        if not self.steerer.graphs.enabled:
            return
        x, y = self._views(self._tap_buffer(aux), source, target)
        plans = StepPlan.shapes(self.buffers, bucket(self.max_rows))
        with torch.inference_mode(False):
            self.buffers.write({}, {})  # every unit the scratch slot, nothing trains
        self.steerer.distill(plans[0], x, y, normalize, head_dtype)  # warms the capture stream
        self.counters["graphs_prepared"] = self.steerer.prepare(plans, x, y, normalize, head_dtype)
        self.steerer.warm_filter(self.vocab, self.device, head_dtype, self.hidden)
        self.counters["padded_prepared"] = self._prepare_padded(head, head_dtype)
        self.records.restart()  # (each capture's eager call staged a record nobody pushed)
        self.counters["prepare_ms"] = round(1e3 * (time.perf_counter() - t0), 1)

    def _prepare_padded(self, head: torch.Tensor | None, head_dtype: torch.dtype) -> int:
        """Capture the padded step (``_padded_step``) of every bucket of rows, with and without the
        top-p passes, with d at the candidates and with no row mixed, on the idle plan buffers
        (every row index -1: the eager call before each capture touches no logits). Returns the
        graphs captured."""
        graphs = self.padded_graphs
        if head is None or not graphs.enabled or not FUSED_FILTER:
            return 0
        if self.bank is None:
            steered = (HeadProduct(self._shared_buffer(head_dtype), head), None, None)
        else:
            outputs = self.bank.outputs(head_dtype)
            if outputs is None:  # the Distiller step runs on the PyTorch path: its outputs move
                return 0
            prediction, errors, losses = outputs
            steered = (HeadProduct(prediction, head), errors, losses)
        at = self._logits_at(self.vocab, self.vocab)  # (vLLM's sampler hands over contiguous rows)
        made, rows = 0, 1
        while rows <= self.row_bucket:
            for cut in (False, True):
                for inputs in (steered, (None, None, None)):
                    product, errors = inputs[0], inputs[1]
                    key = self._padded_key(rows, cut, False, at, product, errors, errors is not None)
                    made += graphs.prepare(key, self._padded_fn(rows, cut, False, at, inputs))
            rows *= 2
        return made

    def keep_taps(self, aux: torch.Tensor) -> bool:
        """Keep every logits row's tap columns (``aux``: [rows, A·H]) where the Distiller step reads
        them, in logits-row order (one copy). False for more rows than a batch holds (not a batch's
        rows: e.g. prompt rows for prompt logprobs), which are not kept. A worker without the bank
        reads no taps and keeps none."""
        if aux.shape[0] > self.max_rows:
            return False
        if self.bank is None:
            return True
        self._tap_buffer(aux)[: aux.shape[0]].copy_(aux)
        return True

    def distill(self, plan: BatchPlan, source: int, target: int, normalize, head_dtype: torch.dtype) -> Handoff:
        """The Distiller step on the plan's steered rows, from the taps ``keep_taps`` kept this
        step; ``source``/``target``: which H-wide column block is which tap. Under tensor
        parallelism rank 0 runs it and broadcasts ŷ of the plan's rows; the other workers receive
        that ŷ (no errors, no losses) and run nothing else."""
        t0 = time.perf_counter()
        if self.bank is None:
            prediction = self.tp.share(self._shared_buffer(head_dtype)[: plan.steered])
            spent = time.perf_counter() - t0
            self.host_seconds += spent
            return Handoff(plan, prediction, None, None, False, spent)
        graphs = self.steerer.graphs
        replays = graphs.replays
        x, y = self._views(self._taps, source, target)
        prediction, errors, losses = self.steerer.distill(plan.step, x, y, normalize, head_dtype)
        if self.tp.size > 1:
            self.tp.share(prediction[: plan.steered])  # the plan's rows come first: a contiguous view
        spent = time.perf_counter() - t0
        self.host_seconds += spent
        return Handoff(plan, prediction, errors, losses, graphs.replays > replays, spent)

    def _shared_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        if self._shared is None or self._shared.dtype != dtype:
            with torch.inference_mode(False):
                self._shared = torch.empty(self.max_rows, self.hidden, dtype=dtype, device=self.device)
        return self._shared

    def apply(
        self,
        plan: BatchPlan,
        logits: torch.Tensor,
        handoff: Handoff | None,
        generated: Sequence[int] | None = None,
        started: float | None = None,
        started_cpu: float | None = None,
    ) -> torch.Tensor:
        """Filter every planned row of ``logits`` and mix the steered ones, in place; one step
        record (on the worker that owns the bank). ``handoff`` None: no taps reached this step, so
        nothing is steered (filters stay exact; counted). ``generated``: per steered row, the
        tokens its request had generated before this step, where the adapter has them as one
        array (else the length of each row's ``output_ids``). ``started``: when the adapter's
        ``apply`` began (``time.perf_counter``), for an adapter that plans and runs the Distiller
        step inside it: the step's host time is then the whole of its ``apply``; ``started_cpu``:
        the thread's CPU time then (``time.thread_time``), to tell a steady step's own work from
        its waits (for the GIL, for the OS) in ``metrics()``'s ``replay_cpu_ms``."""
        t0 = time.perf_counter()
        self.step_no += 1
        step, s = plan.step, plan.steered
        steered = s > 0 and handoff is not None and handoff.d is not None
        if s and not steered:
            self.counters["taps_missing"] += 1
        if not steered:
            d = err = loss = None
        else:
            d, err, loss = handoff.d, handoff.errors, handoff.losses
        reported = err is not None  # the worker that owns the bank keeps the records
        before = (self.padded_graphs.replays, self.padded_graphs.captures)
        before += (self.apply_graphs.replays, self.apply_graphs.captures)
        t_mix = time.perf_counter()
        width = None  # the record's layout: errors and counts as long as the plan's steered rows
        fused = handoff.staged if steered else None  # one graph did the filter and mix too (``_fused_step``)
        # (an update beside this step: ``distill`` queued it, and the padded step may go round it)
        beside = steered and loss is not None and self.steerer.beside_for(step) is not None
        staged = fused if fused is not None else self._padded_step(plan, logits, d, err, reported, beside)
        if staged is not None:
            width = bucket(step.rows)  # ... or as long as the bucket the padded step covers
        else:
            staged = self._general_step(plan, logits, d, err, loss, steered, reported)
        t_records = time.perf_counter()
        if steered:
            self.counters["port_hits"] += s
            if loss is not None:
                self.counters["train_steps"] += 1
        if reported:  # (the step staged its values: ``_padded_fn``, ``_general_step``)
            self.records.push_staged(
                self.step_no,
                plan.groups,
                plan.samples,
                list(map(len, plan.outputs)) if generated is None else generated,
                staged,
                plan.unit_groups if loss is not None else [],
                keep=plan.recorded,
                width=width,
            )
        now = time.monotonic()
        if now - self._last_expire > EXPIRE_EVERY:
            self._last_expire = now
            self.records.expire(self.groups.live)
        end = time.perf_counter()
        cpu = time.thread_time() - started_cpu if started_cpu is not None else 0.0
        distilled = handoff.host_seconds if handoff is not None else 0.0
        if started is None:  # the Distiller step ran earlier in the step (and counted itself)
            self.host_seconds += end - t0
            whole = end - t0 + distilled
        else:  # all of the adapter's apply: its bookkeeping, the plan, the Distiller step, this
            whole = end - started
            self.host_seconds += whole - distilled
        plan_spent, self._plan_spent = self._plan_spent, 0.0
        plan_parts, self._plan_parts = self._plan_parts, [0.0, 0.0, 0.0, 0.0]
        after = (self.padded_graphs.replays, self.padded_graphs.captures)
        after += (self.apply_graphs.replays, self.apply_graphs.captures)
        mix = "eager"
        if fused is not None:
            mix = handoff.mixed
        elif after[0] > before[0] or after[2] > before[2]:
            mix = "replay"
        elif after[1] > before[1] or after[3] > before[3]:
            mix = "capture"
        if steered and handoff.replayed and mix == "replay" and plan_spent:
            self.rebuild_seconds += whole  # a replayed step whose batch changed: its plan was built
            self.counters["rebuild_steps"] += 1
        elif steered and handoff.replayed and mix == "replay":
            self.replay_seconds += whole  # a steady step's host cost, and where it went:
            self.replay_cpu_seconds += cpu
            split = self.replay_split  # the Distiller step, the filter and mix, the record, the rest
            split[0] += distilled
            split[1] += t_records - t_mix
            split[2] += end - t_records
            self.counters["replay_steps"] += 1
        if whole > SLOW_STEP_S:
            entry = dict(
                step=self.step_no,
                at_s=round(time.monotonic() - self._born, 3),
                rows=step.rows,
                steered=s if steered else 0,
                mix=mix,
                padded=width is not None,
                distiller="replay" if steered and handoff.replayed else "eager" if steered else "none",
                host_ms=round(1e3 * whole, 3),
                # the thread's CPU time (an adapter that gives its start): the rest of host_ms waited
                cpu_ms=round(1e3 * cpu, 3) if started_cpu is not None else None,
                plan_ms=round(1e3 * plan_spent, 3),
                distill_ms=round(1e3 * distilled, 3),
                mix_ms=round(1e3 * (t_records - t_mix), 3),
                records_ms=round(1e3 * (end - t_records), 3),
            )
            if plan_spent:
                entry.update(
                    zip(
                        ("plan_rows_ms", "plan_build_ms", "plan_write_ms", "plan_cpu_ms"),
                        (round(1e3 * t, 3) for t in plan_parts),
                    )
                )
            self.slow_steps.append(entry)
        return logits

    def _padded_step(
        self, plan: BatchPlan, logits: torch.Tensor, d, err, reported: bool, beside: bool = False
    ) -> int | None:
        """The filter and mix as one replay of a graph captured for the plan's bucket of rows, read
        where every step's inputs are (``Steerer.filter_and_mix_padded``): the logits' address goes
        to the device when it moved (one small write), nothing else does. Returns how many record
        values the step staged (0 on a worker that keeps no records), or None where this form
        does not apply: graphs off, a plan with top-k or an entropy-matched mix, d not at the
        Distiller's fixed outputs (the PyTorch Distiller; a dense d from the model's own head).
        ``beside``: the step's update runs beside it; a replay then goes on the ``mix_lane``, where
        there is one."""
        graphs, step = self.padded_graphs, plan.step
        if not (
            graphs.enabled
            and FUSED_FILTER
            and step.top_k is None
            and step.matched is None
            and self._padded_logits(logits)
            and (d is not None or not plan.steered)  # (the plan's buffer counts its steered rows as mixed)
        ):
            return None
        # What this plan's padded step reads, worked out at its first step and checked after: the
        # same plan steps with d and the records' values where its first step had them.
        where = (
            None if d is None else d.prediction.data_ptr(),
            None if err is None else err.data_ptr(),
            logits.shape[1],
            logits.stride(0),
        )
        known = plan.padded
        if known is None or known[2] != where:
            inputs = self._fixed_inputs(d, err, logits.shape[1], bucket(step.rows))
            if inputs is None:
                return None
            at = self._logits_at(logits.shape[1], logits.stride(0))
            dense = not plan.few_candidates
            key = self._padded_key(step.rows, step.uses_top_p, dense, at, inputs[0], inputs[1], reported)
            known = plan.padded = (key, self._padded_fn(step.rows, step.uses_top_p, dense, at, inputs), where)
        self._point_at(logits)
        if beside and self.mix_lane is not None and known[0] in graphs.graphs:  # (a replay: no allocation)
            return self.mix_lane.run(graphs.run, known[0], known[1])
        return graphs.run(known[0], known[1])

    def _padded_logits(self, logits: torch.Tensor) -> bool:
        """Whether the padded step reads ``logits`` (through their address): fp32 rows, contiguous,
        on this engine's kind of device."""
        return logits.device.type == self.device.type and logits.dtype == torch.float32 and logits.stride(1) == 1

    def _point_at(self, logits: torch.Tensor) -> None:
        """Put the logits' address where the padded step reads it, when it moved (one small write,
        queued behind the work that made the logits, as the replay is)."""
        address = logits.data_ptr()
        if address != self._logits_address:
            self._address.fill_(address)
            self._logits_address = address
            self.counters["logits_moved"] += 1

    # -- a late adapter's step ---------------------------------------------------------------

    def step_late(
        self,
        plan: BatchPlan,
        logits: torch.Tensor,
        taps: tuple | None,
        generated: Sequence[int] | None = None,
        started: float | None = None,
        started_cpu: float | None = None,
    ) -> torch.Tensor:
        """A late adapter's step (Model Runner V2's): the Distiller step on the taps kept this step,
        then ``apply``. ``taps``: (source, target, normalize, head dtype, the LM head) of the taps
        kept this step, or None (none came: nothing is steered). Where the update runs in line and
        the plan's filter and mix took the padded step once, both are one graph from the plan's
        next step on (``_fused_step``)."""
        handoff = None
        if taps is not None and plan.steered:
            handoff = self._fused_step(plan, logits, taps)
            if handoff is None:
                handoff = self.distill(plan, *taps[:4])
                handoff.d = HeadProduct(handoff.prediction[: plan.steered], taps[4])
        return self.apply(plan, logits, handoff, generated, started, started_cpu)

    def _fused_step(self, plan: BatchPlan, logits: torch.Tensor, taps: tuple) -> Handoff | None:
        """The Distiller step (its update in line) and the padded filter and mix as one call, one
        graph per (Distiller shape, padded step), that reads what the two would: the taps' buffer,
        the plan's buffers, the Distiller's fixed outputs, the logits through their address.
        Returns the step's ``Handoff`` with the count of its staged record values, or None where the two run
        apart: graphs off, the plan's update beside (``Steerer.beside_for``), tensor parallelism (ŷ is
        broadcast between them), a plan whose padded step has not run yet (``plan.padded`` says
        what it reads: d and the records at the Distiller's fixed outputs) or does not apply."""
        known = plan.padded
        graphs, bank = self.fused_graphs, self.bank
        if (
            known is None
            or known[2][0] is None  # (a padded step with d: it reads the Distiller's outputs)
            or not graphs.enabled
            or self.steerer.beside_for(plan.step) is not None
            or not self.steerer.graphs.enabled
            or self.tp.size > 1
            or bank is None
            or not self._padded_logits(logits)
            or known[2][2:] != (logits.shape[1], logits.stride(0))
        ):
            return None
        source, target, normalize, head_dtype, head = taps
        outputs = bank.outputs(head_dtype)
        if outputs is None or outputs[0].data_ptr() != known[2][0]:
            return None
        x, y = self._views(self._taps, source, target)
        key = (Steerer.distill_key(plan.step, x, y, head_dtype), known[0])
        fused = plan.fused
        if fused is None or fused[0] != key:
            evaluate, padded = self.steerer.evaluator(plan.step, normalize, head_dtype), known[1]

            def run():
                evaluate(x, y)  # ŷ, e and the losses land at the Distiller's fixed outputs ...
                return padded()  # ... where the padded step reads them; it stages the record

            fused = plan.fused = (key, run, HeadProduct(outputs[0][: plan.steered], head))
        t0 = time.perf_counter()
        bank.settle()  # an update still beside the step (ESAMP_UPDATE=auto: a larger block's, just before)
        self._point_at(logits)
        replays, captures = graphs.replays, graphs.captures
        staged = graphs.run(fused[0], fused[1])
        mixed = "replay" if graphs.replays > replays else "capture" if graphs.captures > captures else "eager"
        prediction, errors, losses = outputs
        spent = time.perf_counter() - t0  # (counted as the Distiller step's, as ``distill`` counts its own)
        self.host_seconds += spent
        return Handoff(
            plan,
            prediction,
            errors,
            losses if plan.step.layout.training else None,
            mixed == "replay",
            spent,
            d=fused[2],
            staged=staged,
            mixed=mixed,
        )

    def _padded_key(self, rows: int, cut: bool, dense: bool, at: LogitsAt, product, errors, reported: bool) -> tuple:
        """What a padded step's graph reads besides the plan's fixed buffers: its shapes and forms,
        and where d, the records' values and the logits' address are."""
        where = () if product is None else (product.prediction.data_ptr(), product.head.data_ptr())
        if reported:
            where += (errors.data_ptr(),)
        return (bucket(rows), cut, dense and product is not None, at.vocab, at.stride, at.address.data_ptr()) + where

    def _padded_fn(self, rows: int, cut: bool, dense: bool, at: LogitsAt, inputs: tuple):
        """The padded step of plans of ``rows`` rows (any in its bucket): what its graph captures."""
        product, errors, losses = inputs
        R, units = bucket(rows), self.buffers.units

        def run():
            d = None if product is None else HeadProduct(product.prediction[:R], product.head)
            counts = self.steerer.filter_and_mix_padded(self.buffers, R, at, d, dense, cut)
            if errors is None:
                return 0
            # (inside the graph: the record's values need no call of their own)
            return self.records.stage_parts(errors[:R], counts, losses[:units])

        return run

    def _fixed_inputs(self, d, err, vocab: int, rows: int) -> tuple | None:
        """(d as ŷ's whole buffer and the LM head, the Distiller's whole errors and losses) at the
        fixed addresses every step leaves them at, or None where this step's are elsewhere. No d:
        (None, None, None)."""
        if d is None:
            return None, None, None
        if not isinstance(d, HeadProduct) or d.head.shape[0] < vocab:
            return None
        if self.bank is None:  # a tensor-parallel worker without the bank: ŷ as rank 0 sent it
            whole = self._shared
            if whole is None or d.prediction.data_ptr() != whole.data_ptr():
                return None
            return HeadProduct(whole, d.head), None, None
        outputs = self.bank.outputs(d.prediction.dtype)
        if outputs is None:
            return None
        prediction, errors, losses = outputs
        if d.prediction.data_ptr() != prediction.data_ptr() or err.data_ptr() != errors.data_ptr():
            return None
        if errors.numel() < rows or losses.numel() < self.buffers.units:  # (``reserve`` makes them so)
            return None
        return HeadProduct(prediction, d.head), errors, losses

    def _logits_at(self, vocab: int, stride: int) -> LogitsAt:
        at = self._logits_ats.get((vocab, stride))
        if at is None:
            at = self._logits_ats[(vocab, stride)] = LogitsAt(self._address, vocab, stride)
        return at

    def _general_step(self, plan: BatchPlan, logits: torch.Tensor, d, err, loss, steered: bool, reported: bool):
        """The filter and mix of any plan (``Steerer.filter_and_mix``), replayed from a graph of the
        plan's exact shape and of the addresses it reads (the logits' among them), or eager."""
        step, s = plan.step, plan.steered
        if isinstance(d, HeadProduct) and not plan.few_candidates:
            d = d.dense(self.vocab)  # candidates may be every token: one product beats one per candidate
        inputs = tuple(t for t in (logits, d, err, loss) if t is not None)
        # What the captured kernels read: every other input is a fixed buffer of the plan's.
        key = (step.rows, s if steered else 0, step.key, step.mix_key, logits.shape[0], logits.data_ptr()) + (
            (*_addresses(d), reported and err.data_ptr(), loss is not None and loss.data_ptr()) if steered else ()
        )

        def run(logits, *rest):
            d_ = rest[0] if steered else None
            counts = self.steerer.filter_and_mix(step, logits, d_)
            if not reported:
                return 0
            return self.records.stage_parts(rest[1][:s], counts[:s], rest[2] if loss is not None else None)

        if step.matched is not None:  # the matched mix reads its rows' widest |C| on the host: no graph
            return run(*inputs)
        return self.apply_graphs.run(key, run, *inputs)

    # -- groups and results ------------------------------------------------------------------

    def release(self, group: str) -> bool:
        """Free ``group``'s slot now (only the client knows a group is over)."""
        forget = self.forget_rows() if self.forget_rows is not None else None
        if forget is not None:
            forget(group)
        if self.groups.release(group):  # on every TP worker: the ledgers stay the bank's
            self.counters["slots_freed"] += 1
            return True
        return False

    def drain(
        self,
        release=(),
        groups: set[str] | None = None,
        columns: bool = False,
        plain: bool = True,
        wait: float = 0.0,
    ) -> dict:
        """Finished step records (of ``groups``, or all; rows as columns with ``columns``, their
        numbers as arrays unless ``plain``; after waiting up to ``wait`` seconds for the copies in
        flight: ``RecordStore.take``) and counters; frees released groups."""
        for group in release:
            self.release(group)
        steps, pending = self.records.take(groups, columns, plain, wait)
        self.records.expire(self.groups.live)
        slots = self.slots
        return {
            "steps": steps,
            "pending": pending,
            "counters": self.metrics(),
            "free_slots": slots.free_slots if slots is not None else 0,
            "groups": sorted(slots.groups) if slots is not None else [],
        }

    def metrics(self) -> dict:
        """Counters for operators (``esamp.serving`` exposes them in the Prometheus format)."""
        graphs, bank = self.steerer.graphs, self.slots
        self.records.collect()
        self.records.expire(self.groups.live)  # also when the engine is idle and nobody reads
        return dict(
            self.counters,
            steps=self.step_no,
            loss=self.records.loss,
            slots=bank.capacity if bank else 0,
            slots_free=bank.free_slots if bank else 0,
            slots_in_use=len(bank.groups) if bank else 0,
            # (a Distiller step replayed inside a late adapter's one-graph step counts as replayed)
            graph_captures=graphs.captures + self.fused_graphs.captures,
            graph_replays=graphs.replays + self.fused_graphs.replays,
            graph_failures=graphs.failures + self.fused_graphs.failures,
            graph_eager=graphs.eager,
            capture_ms=round(1e3 * graphs.capture_seconds, 1),
            apply_graph_replays=self.apply_graphs.replays,
            apply_graph_failures=self.apply_graphs.failures,
            apply_graph_captures=self.apply_graphs.captures,
            apply_graph_eager=self.apply_graphs.eager,
            apply_capture_ms=round(1e3 * self.apply_graphs.capture_seconds, 1),
            filter_overflows=self.steerer.filter_overflows,
            records_dropped=self.records.dropped,
            host_ms=round(1e3 * self.host_seconds, 1),
            replay_host_ms=round(1e3 * self.replay_seconds, 1),
            rebuild_host_ms=round(1e3 * self.rebuild_seconds, 1),
            replay_cpu_ms=round(1e3 * self.replay_cpu_seconds, 1),
            replay_distill_ms=round(1e3 * self.replay_split[0], 1),
            replay_mix_ms=round(1e3 * self.replay_split[1], 1),
            replay_records_ms=round(1e3 * self.replay_split[2], 1),
            padded_graph_replays=self.padded_graphs.replays,
            padded_graph_captures=self.padded_graphs.captures,
            padded_graph_eager=self.padded_graphs.eager,
            fused_graph_replays=self.fused_graphs.replays,
            fused_graph_captures=self.fused_graphs.captures,
            fused_graph_failures=self.fused_graphs.failures,
            fused_graph_eager=self.fused_graphs.eager,
            plan_ms=round(1e3 * self.plan_seconds, 1),
            slow_steps=list(self.slow_steps),
            **self.ways,
        )


def make_steering(vllm_config, device: torch.device, cls: type[EngineSteering] = EngineSteering) -> EngineSteering:
    """The engine's ``EngineSteering`` from its vLLM configuration (what either adapter builds), then
    the steps other packages registered for it (``hooks``)."""
    server = es.server_settings(vllm_config)
    steering = cls(
        es.engine_config(vllm_config),
        hidden=int(vllm_config.model_config.get_hidden_size()),
        vocab=int(vllm_config.model_config.get_vocab_size()),
        max_rows=int(vllm_config.scheduler_config.max_num_seqs),
        device=device,
        record_all=not server.get("records_requested", False),
        retain_seconds=server.get("records_retain_s"),
        tp=tensor_parallel(vllm_config),
    )
    hooks.steering_ready(steering, vllm_config)  # what other packages add here (none for a library engine)
    return steering
