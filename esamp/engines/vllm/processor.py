"""``EsampLogitsProcessor``: the vLLM adapter of ``esamp.core.steerer`` (V1 logits-processor interface).

It does three things, and the core does the rest:

1. Row bookkeeping. vLLM's own ``process_dict_updates`` keeps batch row → request; a request is
   ours when ``settings.prepare`` (this class's ``validate_params``, run in vLLM's frontend) made
   it an ESamp request. Rows are mapped fresh from every ``BatchUpdate``; state is keyed by
   group, never by row. ``_Groups`` gives each group its Distiller slot.
2. Per step, hand the rows to the core: the model's ``compute_logits`` asks ``plan`` which rows to
   tap, ``distill`` runs the Distiller on them (a CUDA-graph replay once the batch is steady), the
   model runs its LM head once on ``[h; ŷ]`` and hands back d = W·ŷ (``take_distiller_logits``),
   and ``apply`` (vLLM's sampler) filters with the request's own filters (vLLM's functions, so C
   is what vLLM would keep) and mixes. vLLM was handed neutral filters and only draws.
3. Report through ``drain`` (records of ``RecordStore``, counters), called between steps.

Loaded into every vLLM engine of the environment by the ``vllm.logits_processors`` entry point
(so that vLLM 0.20 does not wait for each step's sampled tokens, which it does for processors
passed by name), it is inert where an engine has no ESamp settings (``additional_config``): a
request without ESamp settings costs one call that returns at once. An ESamp request that lands
in such an engine, or finds every slot held by a running group, still gets its own filters:
sampled plainly, never steered with another group's Distiller.

Nothing here reads a device value on the host: a batch's plan is built once per batch change
(host lists copied without blocking), and a steady step is a fixed sequence of kernels.
"""

from __future__ import annotations

import collections
import functools
import importlib
import os
import time
import weakref
from dataclasses import dataclass

import torch

from esamp.core import payload as pl
from esamp.core.backends.graphs import GraphCache
from esamp.core.config import EsampConfig, Filters, Steering
from esamp.core.distiller import DistillerBank
from esamp.core.intervention import NEG_INF
from esamp.core.steerer import SteeredRow, Steerer, StepPlan, device_tensor
from esamp.engines.vllm import settings as es
from esamp.engines.vllm.records import RecordStore
from esamp.engines.vllm.state import STATE
from esamp.errors import EsampError

try:  # vLLM ≤ 0.30: the V1 interface (≥ 0.31's MRv2 interface needs a second adapter)
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates
except ImportError as exc:  # pragma: no cover - depends on the installed vLLM
    raise ImportError(f"this vLLM has no V1 logits-processor interface: {exc}") from exc

try:  # the top-k/top-p filters vLLM's sampler runs (a drift canary holds them to the core's)
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p as vllm_top_k_top_p
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch as vllm_top_k_top_p_cpu
except ImportError:  # pragma: no cover - depends on the installed vLLM
    vllm_top_k_top_p = vllm_top_k_top_p_cpu = None

IDLE_RELEASE_STEPS = 256  # a group with no row in the batch this long gives its slot back
APPLY_GRAPHS = 2  # captured filter-and-mix steps kept (each holds a [R, V] working set)

_built: dict[int, tuple] = {}  # id(vllm_config) → (weak reference to it, ESamp processors built for it)


def _takes_turn(vllm_config, cls: type) -> bool:
    """Whether this instance is the one ESamp processor of its engine that works.

    vLLM builds the entry point's processor first, then those named in ``logits_processors``. When
    an ESamp processor is also named (a subclass, or the class itself by an older command line),
    the last one built works and the others stay out of the way.
    """
    named = 0
    for item in getattr(vllm_config.model_config, "logits_processors", None) or ():
        if isinstance(item, str):
            module, _, name = item.replace(":", ".").rpartition(".")
            try:
                item = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                continue
        named += isinstance(item, type) and issubclass(item, EsampLogitsProcessor)
    expected = int(es.processor_installed()) + named
    ref, index = _built.get(id(vllm_config), (None, 0))
    if ref is None or ref() is not vllm_config:  # a new engine (an old one's id may come back)
        index = 0
    try:
        _built[id(vllm_config)] = (weakref.ref(vllm_config), index + 1)
    except TypeError:  # a config that takes no weak reference: assume one processor
        return True
    return index == max(expected, 1) - 1


def vllm_filter(scaled: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """The request's own filters on z̃, in place (−∞ outside C), as vLLM's sampler applies them.

    min-p in logit space (z̃_c ≥ max z̃ + log min_p is p_c ≥ min_p · p_max without a softmax), then
    the top-k/top-p function vLLM's sampler calls on this device: on a GPU its Triton kernel from
    8 rows up, the sort below that and on a CPU. Where vLLM moved those functions, the core's
    filter, which a canary test holds equal to them.
    """
    if vllm_top_k_top_p is None:
        from esamp.core.steerer import reference_filter

        return reference_filter(scaled, plan)
    if plan.min_p is not None:
        floor = scaled.amax(dim=-1, keepdim=True).add_(plan.log_min_p)
        scaled.masked_fill_(scaled < floor, NEG_INF)
    k = plan.top_k_or_vocab
    if k is not None or plan.top_p is not None:
        if scaled.is_cuda:
            scaled = vllm_top_k_top_p(scaled, k, plan.top_p)
        else:
            scaled = vllm_top_k_top_p_cpu(scaled, k, plan.top_p, allow_cpu_sync=True)
    return scaled


@dataclass(frozen=True)
class _Row:
    group: str
    sample: int
    steering: Steering | None  # None: not steered (the engine runs without ESamp)
    filters: Filters
    output_ids: list[int]  # the request's generated ids (a live list): its length is the
    # generation index of the token sampled this step
    records: bool
    n: int | None  # samples in the row's group, when the request said


@dataclass
class _Plan:
    """One batch shape: which logits rows are steered or only filtered, and their core plans."""

    rows: int
    idx: torch.Tensor | None  # steered logits rows, or None when that is every row in order
    steered: StepPlan | None
    members: list[_Row]  # the steered rows, in plan order
    groups: list[str]
    samples: list[int]
    outputs: list[list[int]]
    recorded: set[str] | None  # groups whose records are kept (None: every group's)
    plain_idx: torch.Tensor | None  # rows that only get their own filters
    plain: StepPlan | None
    shape: int  # hash of what the steered rows' kernels read: equal shapes run the same filter and mix
    loss_groups: list[str]  # the group of each training slot, in the order the losses come


@dataclass
class _Distilled:
    """What ``distill`` computed this step, for ``apply``."""

    plan: _Plan
    errors: torch.Tensor  # [n] raw Distiller error per steered row
    losses: torch.Tensor | None  # per training slot
    replayed: bool  # the Distiller step was a CUDA-graph replay
    host_seconds: float  # host time ``distill`` took
    d: torch.Tensor | None = None  # [n, V] Distiller logits, from the model's LM head


@functools.lru_cache(maxsize=4096)
def _decode(items: tuple) -> pl.Payload | None:
    return pl.decode(dict(items))


class _Groups:
    """Prompt groups: their Distiller slots, when each was last in a batch, its samples."""

    def __init__(self, bank: DistillerBank | None) -> None:
        self.bank = bank
        self.last_seen: dict[str, int] = {}
        self.samples_seen: dict[str, set[int]] = collections.defaultdict(set)
        self.arrivals: dict[str, dict[int, tuple[list[int], int]]] = collections.defaultdict(dict)
        self.live: set[str] = set()

    def sample_of(self, group: str, output_ids: list[int]) -> int:
        """The next free sample index of ``group``, stable for a request that leaves the batch and
        comes back (its id list is the same object; held here so its id is not reused)."""
        seen = self.arrivals[group]
        if id(output_ids) not in seen:
            seen[id(output_ids)] = (output_ids, len(seen))
        return seen[id(output_ids)][1]

    def slot(self, group: str, step: int, counters) -> int | None:
        """``group``'s slot, taking one (evicting the group idle longest) when it has none; None
        when every slot is held by a group with rows in the batch."""
        bank = self.bank
        if group not in bank.groups and bank.free_slots == 0:
            idle = [g for g in bank.groups if g not in self.live]
            if not idle:
                counters["bank_full"] += 1
                return None
            self.release(min(idle, key=lambda g: self.last_seen.get(g, -1)))
            counters["slots_evicted"] += 1
        self.last_seen[group] = step
        return bank.allocate(group)

    def arrived(self, row: "_Row") -> None:
        self.samples_seen[row.group].add(row.sample)

    def complete(self, row: "_Row") -> bool:
        """Whether every sample of the row's group has been in a batch. A served request's n
        children reach the engine one after another; training waits for all of them, so the
        Distiller's first steps see the whole group, as in the library engine."""
        return row.n is None or len(self.samples_seen[row.group]) >= row.n

    def release(self, group: str) -> bool:
        self.arrivals.pop(group, None)
        self.samples_seen.pop(group, None)
        self.last_seen.pop(group, None)
        if self.bank is not None and group in self.bank.groups:
            self.bank.free(group)
            return True
        return False

    def release_idle(self, step: int) -> int:
        old = [g for g, s in self.last_seen.items() if g not in self.live and step - s > IDLE_RELEASE_STEPS]
        return sum(self.release(g) for g in old)


class EsampLogitsProcessor(LogitsProcessor):
    """ESamp on the rows of requests that ``validate_params`` prepared."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.device = torch.device(device)
        self.rows: dict[int, _Row] = {}
        self.working = _takes_turn(vllm_config, type(self))
        self._plan: _Plan | None = None
        self._ctx: _Distilled | None = None
        self.vocab = int(vllm_config.model_config.get_vocab_size())
        self.config: EsampConfig | None = es.engine_config(vllm_config) if self.working else None
        server = (getattr(vllm_config, "additional_config", None) or {}).get(es.SERVER_KEY) or {}
        self.record_all = not server.get("records_requested", False)
        self.step = 0
        self.counters: collections.Counter = collections.Counter()
        self.host_seconds = self.replay_seconds = 0.0
        self.steerer: Steerer | None = None
        if self.config is not None:
            with torch.inference_mode(False):
                bank = DistillerBank(
                    int(vllm_config.model_config.get_hidden_size()), rank=self.config.rank,
                    slots=self.config.slots, lr=self.config.lr, optimizer=self.config.optimizer,
                    device=self.device, seed=self.config.seed)
            graphs = self.device.type == "cuda" and os.environ.get("ESAMP_CUDA_GRAPHS", "1") != "0"
            self.steerer = Steerer(bank, filter=vllm_filter, graphs=GraphCache(enabled=graphs))
        # The filter and the mix read the sampler's logits where they are (no copy of [R, V]).
        self.apply_graphs = GraphCache(enabled=self.steerer is not None and self.steerer.graphs.enabled,
                                       size=APPLY_GRAPHS, in_place=True)
        self.groups = _Groups(self.steerer.bank if self.steerer else None)
        self.records = RecordStore(self.device)
        self.channel = None
        if self.working:
            STATE.set_processor(self)
            if self.config is not None:
                from esamp.engines.vllm import channel

                self.channel = channel.start(self, server, vllm_config)

    @property
    def bank(self) -> DistillerBank | None:
        return self.steerer.bank if self.steerer is not None else None

    # -- the interface -----------------------------------------------------------------------

    @classmethod
    def validate_params(cls, params) -> None:
        es.prepare(params)

    def is_argmax_invariant(self) -> bool:
        return False  # ESamp moves the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None and self.working and process_dict_updates(self.rows, batch_update, self._new_row):
            self._plan = None

    def _new_row(self, params, _prompt_ids, output_ids: list[int]) -> _Row | None:
        extra = params.extra_args
        if not extra:
            return None
        try:
            payload = _decode(tuple(sorted((k, v) for k, v in extra.items() if k.startswith(pl.PREFIX))))
        except (EsampError, TypeError):
            self.counters["bad_requests"] += 1  # validate_params refused it; it never runs
            return None
        if payload is None or payload.filters is None or payload.group is None:
            return None  # not prepared: vLLM applies the request's filters itself
        group = payload.group
        if payload.sample is not None:
            sample = payload.sample
        elif payload.seed is not None and params.seed is not None:
            sample = params.seed - payload.seed  # child i of a seeded request has seed + i
        else:
            sample = self.groups.sample_of(group, output_ids)
        steering = payload.steering_over(self.config) if self.config is not None else None
        return _Row(group, sample, steering, payload.filters, output_ids,
                    records=self.record_all or bool(payload.records), n=payload.n)

    # -- the step ----------------------------------------------------------------------------

    def plan(self, rows: int) -> _Plan | None:
        """This step's plan for ``rows`` logits rows, or None when no row is ours.

        Called by the model's ``compute_logits`` before it touches the taps, and by ``apply``.
        """
        if not self.rows:
            return None
        plan = self._plan
        if plan is None or plan.rows != rows:
            plan = self._plan = self._build(rows)
        return plan

    def _build(self, rows: int) -> _Plan:
        step = self.step
        self.groups.live = {r.group for r in self.rows.values()}
        steered, plain = [], []
        for index in sorted(i for i in self.rows if i < rows):
            row = self.rows[index]
            slot = None
            if row.steering is not None and row.steering.enabled:
                slot = self.groups.slot(row.group, step, self.counters)
            (steered if slot is not None else plain).append((index, row, slot))
        self.counters["slots_released"] += self.groups.release_idle(step)
        with torch.inference_mode(False):
            def idx(chosen):
                order = [i for i, _, _ in chosen]
                return None if order == list(range(rows)) else device_tensor(order, torch.long, self.device)

            for _, r, _ in steered:
                self.groups.arrived(r)
            complete = {id(r): self.groups.complete(r) for _, r, _ in steered}
            splan = StepPlan.build([SteeredRow(s, r.steering, r.filters, complete[id(r)]) for _, r, s in steered],
                                   self.device, vocab=self.vocab) if steered else None
            pplan = StepPlan.build([SteeredRow(-1, Steering(enabled=False), r.filters) for _, r, _ in plain],
                                   self.device, vocab=self.vocab, distill=False) if plain else None
            return _Plan(rows=rows, idx=idx(steered) if steered else None, steered=splan,
                         members=[r for _, r, _ in steered], groups=[r.group for _, r, _ in steered], samples=[r.sample for _, r, _ in steered],
                         outputs=[r.output_ids for _, r, _ in steered],
                         recorded=None if self.record_all else {r.group for _, r, _ in steered if r.records},
                         plain_idx=idx(plain) if plain else None, plain=pplan,
                         shape=hash((tuple(i for i, _, _ in steered), splan.key if splan else None,
                                     tuple((r.steering.mix, r.steering.beta) + tuple(r.filters.model_dump().values())
                                           for _, r, _ in steered))),
                         loss_groups=self._training_groups(splan, [s for _, _, s in steered],
                                                           [r.group for _, r, _ in steered]))

    def distill(self, plan: _Plan, source: torch.Tensor, target: torch.Tensor, normalize=None,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """ŷ [n, H] for the plan's steered rows, from their tapped rows (in the plan's order);
        with ``hidden`` (the LM head's input rows), ``[hidden; ŷ]`` for one head pass.
        ``normalize(source, target) -> (x, y)``: the taps' norms, run inside the Distiller step."""
        t0 = time.perf_counter()
        graphs = self.steerer.graphs
        replays = graphs.replays
        prediction, errors, losses = self.steerer.distill(plan.steered, source, target, normalize, hidden)
        spent = time.perf_counter() - t0
        self._ctx = _Distilled(plan, errors, losses, graphs.replays > replays, spent)
        self.host_seconds += spent
        return prediction

    def take_distiller_logits(self, d: torch.Tensor) -> None:
        """d = W·ŷ [n, V] for this step's steered rows (plan order), from the model's LM head."""
        if self._ctx is not None:
            self._ctx.d = d

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        t0 = time.perf_counter()
        ctx, self._ctx = self._ctx, None
        R = logits.shape[0]
        plan = self.plan(R)
        self.step += 1
        if plan.plain is not None:  # rows that only get their own filters
            self._filter_rows(logits, plan.plain_idx, plan.plain)
        if plan.steered is None:
            return logits
        if ctx is None or ctx.plan is not plan or ctx.d is None:
            # No taps reached us this step (a model without taps?): the filters stay exact, but
            # nothing is steered; the counters say so.
            self._filter_rows(logits, plan.idx, plan.steered)
            self.counters["stash_miss"] += 1
            return logits
        inputs = (logits, ctx.d, ctx.errors) + ((ctx.losses,) if ctx.losses is not None else ())
        key = (plan.shape,) + tuple((t.data_ptr(), tuple(t.shape)) for t in inputs)
        packed = self.apply_graphs.run(key, functools.partial(self._steer, plan), *inputs, keep=plan)
        self.counters["port_hits"] += plan.steered.rows
        if ctx.losses is not None:
            self.counters["train_steps"] += 1
        # Every steered step leaves a record (its losses feed the counters even when no reader
        # wants its rows).
        self.records.push(self.step, plan.groups, plan.samples, [len(o) for o in plan.outputs], packed,
                          plan.loss_groups if ctx.losses is not None else [], keep=plan.recorded)
        spent = time.perf_counter() - t0
        self.host_seconds += spent
        if ctx.replayed:  # a steady step: what ESamp costs the host per step once warmed up
            self.replay_seconds += spent + ctx.host_seconds
            self.counters["replay_steps"] += 1
        return logits

    def _steer(self, plan: _Plan, logits: torch.Tensor, d: torch.Tensor, errors: torch.Tensor,
               losses: torch.Tensor | None = None) -> torch.Tensor:
        """Filter and mix the steered rows of ``logits`` in place; the step's record, packed.
        A fixed sequence of kernels: replayed as a CUDA graph once the batch is steady."""
        z = logits if plan.idx is None else logits.index_select(0, plan.idx)
        scaled = self.steerer.filter(plan.steered, z)
        out, candidates = self.steerer.mix(plan.steered, scaled, d)
        if plan.idx is not None:
            logits.index_copy_(0, plan.idx, out)
        return RecordStore.pack(errors, candidates, losses)

    def _filter_rows(self, logits: torch.Tensor, idx: torch.Tensor | None, plan: StepPlan) -> None:
        z = logits if idx is None else logits.index_select(0, idx)
        out = self.steerer.filter(plan, z) if self.steerer is not None else vllm_filter(z.div_(plan.temperature), plan)
        if idx is not None:
            logits.index_copy_(0, idx, out)

    @staticmethod
    def _training_groups(splan: StepPlan | None, slots: list[int], groups: list[str]) -> list[str]:
        """The group of each training slot, in the order the losses come."""
        if splan is None or splan.training is None:
            return []
        by_slot = dict(zip(slots, groups))
        return [by_slot[s] for s in splan.training.slots]

    # -- results -----------------------------------------------------------------------------

    def release(self, group: str) -> None:
        """The client is done with ``group``: free its slot now (only the client knows a group
        is over: a request can leave the batch and come back, and a finished request leaves the
        batch only at the next step)."""
        for index in [i for i, r in self.rows.items() if r.group == group]:
            del self.rows[index]  # its requests may still be in the batch until the next step
            self._plan = None
        if self.groups.release(group):
            self.counters["slots_freed"] += 1

    def drain(self, release: list[str] | tuple[str, ...] = (), groups: set[str] | None = None) -> dict:
        """Finished step records (of ``groups``, or all) and counters; frees released groups."""
        for group in release:
            self.release(group)
        steps, pending = self.records.take(groups)
        self.records.expire(self.groups.live)
        return {"steps": steps, "pending": pending, "counters": self.metrics(),
                "free_slots": self.bank.free_slots if self.bank is not None else 0,
                "groups": sorted(self.bank.groups) if self.bank is not None else []}

    def metrics(self) -> dict:
        """Counters for operators (``esamp.serving`` exposes them in the Prometheus format)."""
        graphs = self.steerer.graphs if self.steerer is not None else None
        bank = self.bank
        self.records.collect()
        return dict(self.counters, steps=self.step, loss=self.records.loss,
                    slots=bank.capacity if bank else 0, slots_free=bank.free_slots if bank else 0,
                    slots_in_use=len(bank.groups) if bank else 0,
                    graph_captures=graphs.captures if graphs else 0, graph_replays=graphs.replays if graphs else 0,
                    graph_failures=graphs.failures if graphs else 0,
                    apply_graph_replays=self.apply_graphs.replays if graphs else 0,
                    apply_graph_failures=self.apply_graphs.failures if graphs else 0, records_dropped=self.records.dropped,
                    host_ms=round(1e3 * self.host_seconds, 1), replay_host_ms=round(1e3 * self.replay_seconds, 1))
