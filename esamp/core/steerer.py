"""One ESamp step over a batch of rows, in the order it runs. Every engine runs this.

1. ``distill``: each row's group Distiller predicts ŷ from the source tap x; the row's error
   e = mean_H (ŷ − y)² against the target tap y is the novelty of the token that was its input;
   the rows that train take one optimizer step per slot (``esamp.core.distiller``).
2. ``filter``: z̃ = z / T, then the request's own min-p, top-k and top-p keep the candidates C;
   everything else becomes −∞ (``esamp.core.intervention.candidate_mask``).
3. ``mix``: z' = a·z̃ − b·d on C, with d = W_lm·ŷ the Distiller logits and (a, b) from the row's
   mix and β (``esamp.core.mixes``); rows of an entropy-matched mix are then rescaled to plain
   sampling's entropy over C (``intervention.match_entropy``). Engines then sample from z' as they
   would from z̃.

An engine describes its steered rows once per batch as a ``StepPlan`` (each row's slot and
settings, as device tensors) and runs the steps every decode step. The PyTorch functions of
``esamp.core`` are the reference; faster backends do the same work and tests hold each one equal
to the reference:

- distill: ``backends.graphs.GraphCache`` replays the step as a CUDA graph. A plan built on
  ``PlanBuffers`` keeps every tensor at a fixed address and pads its block to a bucketed
  [U, W] shape, so one graph per shape serves every batch and every assignment of groups to
  slots; ``Steerer.prepare`` captures the common shapes before the first request. With a
  ``SideStream`` the step's update (``DistillerBank.learn``) is a second graph on a stream of its
  own, beside what follows the prediction; the bank makes the next reader of its parameters wait.
- filter and mix: ``backends.triton_filter.filter_and_mix`` does both in four passes over the
  logits (no sort of the vocabulary; two when no row's top-p is below 1), on rows picked by index
  where they lie. It knows only the
  (a, b) form: a plan with entropy-matched rows (or top-k) takes the PyTorch path instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from esamp.core import intervention as iv, mixes
from esamp.core.backends.graphs import GraphCache, SideStream
from esamp.core.backends.triton_filter import FilterWorkspace, LogitsAt, filter_and_mix, launch
from esamp.core.backends.triton_mix import mix_and_count
from esamp.core.config import Filters, Steering
from esamp.core.distiller import DistillerBank, HostLayout, RowLayout, block_shape

# ESAMP_FILTER=sort runs every plan through the constructor's filter (vLLM's top-k/top-p function in
# the vLLM engine) and the separate mix, as before the fused kernels: for measuring them against it.
FUSED_FILTER = os.environ.get("ESAMP_FILTER", "fused") != "sort"


@dataclass(frozen=True)
class SteeredRow:
    """One row to steer: the slot of its group and the group's settings."""

    slot: int
    steering: Steering
    filters: Filters
    may_train: bool = True  # False holds this row's training back (its group is not all there yet)
    # The row's prompt group, for train_rows "group" (its first row in the step trains). None: the
    # slot's rows are one group, as in a bank; rows of the shared Distiller must name their group.
    group: Hashable | None = None


def bucket(n: int) -> int:
    """The padded size of a block dimension: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


class PlanBuffers:
    """Fixed device buffers a plan's tensors are views of, for up to ``rows`` rows, ``units``
    slots per step and ``width`` rows per slot: a plan built here keeps its tensors at the same
    addresses as every other plan of its shape (what a captured graph reads). Rebuilding a plan is
    two small host-to-device copies, queued behind the work that read the previous one."""

    def __init__(self, rows: int, units: int, width: int, device: torch.device, scratch: int) -> None:
        self.rows, self.units, self.width = rows, units, width
        self.cells = units * width
        self.device, self.scratch = torch.device(device), scratch
        # Per-row fields are as long as the bucket of ``rows``: a launch captured for a bucket reads
        # them up to its end (``padded``), past a plan's rows (index -1 there: no row).
        per_row = bucket(rows)
        # long: units | gather | cell | row of each cell | row index | top-k | mixed rows ;
        # float: weight | T | min-p | top-p | a | b | matched
        self._long_spans = _spans(
            units=units, gather=self.cells, cell=self.cells, row_of=self.cells, index=per_row, top_k=per_row, mixed=1
        )
        self._float_spans = _spans(
            weight=self.cells,
            temperature=per_row,
            min_p=per_row,
            top_p=per_row,
            a=per_row,
            b=per_row,
            matched=per_row,
        )
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        # id(row) → (row, steered, its numbers), the last plan's rows (``StepPlan.build``)
        self.row_values: dict[int, tuple] = {}
        self.write_seconds = 0.0  # host time of the latest ``write`` (for a rebuild's account)
        with torch.inference_mode(False):
            self.longs = torch.zeros(self._long_spans["_end"], dtype=torch.long, device=self.device)
            self.floats = torch.zeros(self._float_spans["_end"], dtype=torch.float32, device=self.device)
        self.write({}, {})

    def fits(self, rows: int, units: int, width: int) -> bool:
        return rows <= self.rows and units <= self.units and width <= self.width

    def view(self, name: str, size: int) -> torch.Tensor:
        """The first ``size`` entries of field ``name`` (the same view object every time: a plan
        build asks for a dozen, and a slice of a CUDA tensor costs microseconds)."""
        key = (name, size)
        out = self._views.get(key)
        if out is None:
            if name in self._long_spans:
                out = self.longs[self._long_spans[name] :][:size]
            else:
                out = self.floats[self._float_spans[name] :][:size]
            self._views[key] = out
        return out

    def padded(self, name: str, rows: int) -> torch.Tensor:
        """A per-row field's first ``bucket(rows)`` entries: a plan's rows, then idle ones."""
        return self.view(name, bucket(rows))

    def write(self, longs: dict[str, list[int]], floats: dict[str, list[float]]) -> None:
        """Set every field: the named ones from their start, everything else to its idle value
        (units: the scratch slot; gather: the zero row; row of each cell: none; row index: -1,
        no row; weights 0: nothing trains; mixed rows: 0)."""
        t0 = time.perf_counter()
        for buffer, spans, values, dtype in (
            (self.longs, self._long_spans, longs, np.int64),
            (self.floats, self._float_spans, floats, np.float32),
        ):
            host = np.zeros(spans["_end"], dtype=dtype)
            if dtype is np.int64:
                host[spans["units"] : spans["gather"]] = self.scratch
                host[spans["gather"] : spans["cell"]] = self.rows
                host[spans["row_of"] : spans["index"]] = -1
                host[spans["index"] : spans["top_k"]] = -1
            for name, items in values.items():
                host[spans[name] : spans[name] + len(items)] = items
            staged = torch.from_numpy(host)
            if self.device.type == "cuda":
                staged = staged.pin_memory()  # (the host allocator keeps it until the copy is done)
            buffer.copy_(staged, non_blocking=True)
        self.write_seconds = time.perf_counter() - t0


def _row_values(row: SteeredRow, steered: bool) -> tuple:
    """A row's numbers in a plan: (T, min-p, top-p, top-k, a, b, entropy-matched), T = 1 for a
    greedy row, and (a, b) = (1, 0), unmatched, for a row only filtered."""
    x = row.filters
    temperature = x.temperature if x.temperature > 0 else 1.0
    if not steered:
        return temperature, x.min_p, x.top_p, x.top_k, 1.0, 0.0, 0.0
    a, b = mixes.coefficients(row.steering.mix, row.steering.beta)  # (as iv.mix_coefficients)
    matched = float(mixes.matches_entropy(row.steering.mix))
    return temperature, x.min_p, x.top_p, x.top_k, float(a), float(b), matched


def _spans(**sizes: int) -> dict[str, int]:
    out, offset = {}, 0
    for name, size in sizes.items():
        out[name] = offset
        offset += size
    out["_end"] = offset
    return out


@dataclass(frozen=True)
class StepPlan:
    """A batch of rows as device tensors: the first ``steered`` rows are steered (distilled and
    mixed), the rest only filtered. Built when the batch changes, reused after."""

    rows: int
    steered: int
    layout: RowLayout | None  # the steered rows' block; None when no row is steered
    temperature: torch.Tensor  # [R]; 1 for greedy rows (their argmax is what counts)
    min_p: torch.Tensor  # [R], 0 = off
    top_p: torch.Tensor  # [R], 1 = off
    top_k: torch.Tensor | None  # [R] long, 0 = off; None when no row uses top-k
    a: torch.Tensor  # [R] weight of z̃ in the mix (1 for rows only filtered)
    b: torch.Tensor  # [R] weight of d (0 for rows only filtered)
    index: torch.Tensor | None = None  # [R] the engine's logits row of each row, when given
    matched: torch.Tensor | None = None  # [R] 1.0 where the row's mix matches plain entropy; None: no row
    trains: tuple[bool, ...] = ()  # per steered row: whether it trains the Distiller this step (host)
    uses_top_p: bool = True  # some row's top-p is below 1 (False: the filter needs no top-p cut)

    @property
    def key(self) -> tuple:
        """What the Distiller step's kernels depend on: equal keys replay the same graph."""
        return (self.layout.shape, bool(self.layout.training)) if self.layout is not None else ()

    @property
    def mix_key(self) -> tuple:
        """What picks the filter-and-mix path beyond shapes (``Steerer.filter_and_mix``): rows with
        top-k take the constructor's filter, entropy-matched rows the PyTorch mix. A graph of that
        step is valid only for plans with the same ``mix_key``."""
        return (self.top_k is not None, self.matched is not None, self.uses_top_p)

    def matched_rows(self, rows: int | None = None) -> torch.Tensor | None:
        """[rows, 1] bool of the first ``rows`` rows (all by default): those to entropy-match."""
        if self.matched is None:
            return None
        return (self.matched[: self.rows if rows is None else rows] > 0).reshape(-1, 1)

    @classmethod
    def build(
        cls,
        rows: Sequence[SteeredRow],
        device: torch.device | str = "cpu",
        *,
        steered: int | None = None,
        index: Sequence[int] | None = None,
        buffers: PlanBuffers | None = None,
    ) -> StepPlan:
        """The plan of ``rows``, the first ``steered`` of them (default: all) steered and the rest
        only filtered (their (a, b) = (1, 0) whatever their steering says); ``index``: each row's
        logits row in the engine's batch. With ``buffers`` the block is padded to bucketed sizes,
        every tensor is a view of them, and the Distiller step reads each steered row's taps at
        its logits row (the engine keeps every row's taps in logits order)."""
        device = torch.device(device)
        n = len(rows)
        s = n if steered is None else steered
        slots = [r.slot for r in rows[:s]]
        trains, seen = [], set()
        for r in rows[:s]:  # train_rows "group": the group's first row in this step trains
            group = r.slot if r.group is None else r.group
            trains.append(r.may_train and r.steering.train and (r.steering.train_rows == "all" or group not in seen))
            seen.add(group)
        known = buffers.row_values if buffers is not None else {}
        kept: dict[int, tuple] = {}
        numbers = []
        for i, r in enumerate(rows):  # each row's numbers, worked out once while the row object stays
            hit = known.get(id(r))
            if hit is None or hit[0] is not r or hit[1] != (i < s):
                hit = (r, i < s, _row_values(r, i < s))
            kept[id(r)] = hit
            numbers.append(hit[2])
        if buffers is not None:
            buffers.row_values = kept  # (the rows of this plan only: the others' objects may go)
        temperature, min_p, top_p, top_k, a, b, matched = map(list, zip(*numbers)) if n else ([] for _ in range(7))
        values = dict(temperature=temperature, min_p=min_p, top_p=top_p, a=a, b=b)
        uses_matched = any(matched)
        if uses_matched:
            values["matched"] = matched
        uses_top_k = any(k > 0 for k in top_k)
        uses_top_p = any(p < 1 for p in top_p)
        if buffers is None:
            layout = RowLayout.from_slots(slots, trains, device=device) if s else None
            tensors = {k: torch.tensor(v, dtype=torch.float32).to(device) for k, v in values.items()}
            return cls(
                rows=n,
                steered=s,
                layout=layout,
                **tensors,
                top_k=torch.tensor(top_k, dtype=torch.long).to(device) if uses_top_k else None,
                index=None if index is None else torch.tensor(list(index), dtype=torch.long).to(device),
                trains=tuple(trains),
                uses_top_p=uses_top_p,
            )
        longs: dict[str, list[int]] = {"top_k": top_k, "index": list(index) if index is not None else [], "mixed": [s]}
        layout = None
        if s:
            U, W = block_shape(slots)
            U, W = min(bucket(U), buffers.units), min(bucket(W), buffers.width)
            host = HostLayout.of(
                slots,
                trains,
                units=U,
                width=W,
                scratch=buffers.scratch,
                zero_row=buffers.rows,
                sources=None if index is None else list(index[:s]),
            )
            longs.update(units=host.units, gather=host.gather, cell=host.cell, row_of=host.row_of)
            values["weight"] = host.weight
            layout = RowLayout(
                buffers.view("units", U),
                buffers.view("gather", U * W),
                buffers.view("cell", U * W),
                buffers.view("weight", U * W),
                buffers.view("row_of", U * W),
                s,
                W,
                buffers.rows,
                host.slots,
                host.training,
            )
        buffers.write(longs, values)
        return cls(
            rows=n,
            steered=s,
            layout=layout,
            **{k: buffers.view(k, n) for k in values if k != "weight"},
            top_k=buffers.view("top_k", n) if uses_top_k else None,
            index=buffers.view("index", n) if index is not None else None,
            trains=tuple(trains),
            uses_top_p=uses_top_p,
        )

    @classmethod
    def shapes(cls, buffers: PlanBuffers, cells: int) -> list[StepPlan]:
        """Plans of every bucketed block shape up to ``cells`` cells, on ``buffers``, whose units
        are the scratch slot and whose rows train nothing: what ``Steerer.prepare`` captures."""
        out = []
        units = 1
        while units <= buffers.units:
            width = 1
            while width <= buffers.width and units * width <= cells:
                out.append(cls._idle(buffers, units, width))
                width *= 2
            units *= 2
        return out

    @classmethod
    def _idle(cls, buffers: PlanBuffers, units: int, width: int) -> StepPlan:
        cells = units * width
        layout = RowLayout(
            buffers.view("units", units),
            buffers.view("gather", cells),
            buffers.view("cell", cells),
            buffers.view("weight", cells),
            buffers.view("row_of", cells),
            0,
            width,
            buffers.rows,
            (),
            (0,),
        )
        one = buffers.view("a", 1)
        return cls(rows=0, steered=0, layout=layout, temperature=one, min_p=one, top_p=one, top_k=None, a=one, b=one)


def reference_filter(scaled: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """The core's candidate filter on z̃ [R, V]: −∞ outside C, in place."""
    R = scaled.shape[0]
    mask = iv.candidate_mask(
        scaled,
        plan.top_k if plan.top_k is not None else torch.zeros(R, dtype=torch.long, device=scaled.device),
        plan.top_p,
        plan.min_p,
    )
    return scaled.masked_fill_(~mask, iv.NEG_INF)


Filter = Callable[[torch.Tensor, StepPlan], torch.Tensor]


class Steerer:
    """Runs ESamp's step over a ``StepPlan``'s rows with the given backends."""

    def __init__(
        self,
        bank: DistillerBank,
        *,
        filter: Filter = reference_filter,
        graphs: GraphCache | None = None,
        beside: SideStream | None = None,
        inline_cells: int = 0,
    ) -> None:
        self.bank = bank
        self._filter = filter
        self.graphs = graphs or GraphCache(enabled=False)
        self.beside = beside  # where the Distiller's update runs on a GPU (None: in line)
        # Blocks of up to this many cells (a step's steered rows, about) take their update in line
        # even with ``beside``: a step of few rows leaves the update no room beside it (``beside_for``)
        self.inline_cells = inline_cells
        self._work: FilterWorkspace | None = None

    def beside_for(self, plan: StepPlan) -> SideStream | None:
        """Where the update of ``plan``'s Distiller step runs: ``beside``, or None (in line) for a
        block of at most ``inline_cells`` cells. A function of the plan's ``key``, so each captured
        step has one way."""
        if self.beside is None or plan.layout is None:
            return self.beside
        units, width = plan.layout.shape
        return None if units * width <= self.inline_cells else self.beside

    # -- distill -----------------------------------------------------------------------------

    def distill(
        self, plan: StepPlan, x: torch.Tensor, y: torch.Tensor, normalize=None, out_dtype: torch.dtype | None = None
    ):
        """(ŷ, e, loss per unit or None) for the plan's rows, from their taps ``x`` and ``y``.

        ``normalize(x, y) -> (x, y)``, when given, turns the engine's raw taps into the Distiller's
        inputs inside the step; ``out_dtype`` casts ŷ inside it (e.g. to the LM head's dtype). For
        a plan on ``PlanBuffers``, ``x`` and ``y`` are the engine's fixed tap buffers (every logits
        row's taps, the buffer's last row zero) and ŷ, e have a row per block cell, the plan's rows
        first; the step runs as a CUDA graph per plan shape, reading its inputs where they are.
        With ``beside``, the update runs there (``SideStream``): ŷ, e and the losses are ready as
        soon as the prediction is, and the update lands before anything reads the parameters.
        Without, it runs in the same call, after the prediction: one graph, no stream to order.
        """
        self.bank.settle()  # the previous step's update first (below)
        key = self.distill_key(plan, x, y, out_dtype)
        prediction, errors, losses, update = self.graphs.run(key, self.evaluator(plan, normalize, out_dtype), x, y)
        beside = self.beside_for(plan)
        if update is not None and beside is not None:
            # The update is not needed before the next step's prediction: it runs beside what
            # follows (the mix, the sampler, the model's next forward) instead of before it, as a
            # graph of its own where the prediction was one (its inputs then stay where they are).
            learn_key = ("learn", plan.key) + tuple(t.data_ptr() for t in update.reads)
            graphed = key in self.graphs.graphs
            self.bank.updating(beside.run(learn_key, update.run, *update.reads, graphed=graphed))
        return prediction, errors, losses

    def evaluator(self, plan: StepPlan, normalize=None, out_dtype: torch.dtype | None = None) -> Callable:
        """The Distiller step of ``plan`` as one call ``(x, y) -> (ŷ, e, loss, update)``, what
        ``distill`` runs or captures: in line (``beside_for`` None) the update runs in the same
        call, after the prediction, and ``update`` is None."""
        inline = self.beside_for(plan) is None

        def evaluate(gx, gy):
            out = self.bank.evaluate(gx, gy, plan.layout, normalize, out_dtype)
            if inline and out[3] is not None:  # in line: the update in the same call (one graph)
                out[3].run(*out[3].reads)
                return (*out[:3], None)
            return out

        return evaluate

    @staticmethod
    def distill_key(plan: StepPlan, x: torch.Tensor, y: torch.Tensor, out_dtype: torch.dtype | None) -> tuple:
        """What a captured Distiller step of ``plan`` reads besides the plan's fixed buffers: its
        shape, ŷ's dtype and where the taps are."""
        return (plan.key, out_dtype, x.data_ptr(), y.data_ptr(), x.stride(0), y.stride(0))

    def prepare(
        self,
        plans: Sequence[StepPlan],
        x: torch.Tensor,
        y: torch.Tensor,
        normalize=None,
        out_dtype: torch.dtype | None = None,
    ) -> int:
        """Capture the Distiller step of each plan's shape ahead of use (plans whose units are the
        scratch slot and whose rows train nothing change no state). Returns the captures made."""
        before = self.graphs.captures
        for plan in plans:
            if not self.graphs.enabled:
                break
            self.distill(plan, x, y, normalize, out_dtype)
        return self.graphs.captures - before

    # -- filter and mix ----------------------------------------------------------------------

    def filter(self, plan: StepPlan, logits: torch.Tensor) -> torch.Tensor:
        """z̃ = z/T with −∞ outside C, in place on ``logits`` ([R, V], fp32)."""
        return self._filter(logits.div_(plan.temperature.reshape(-1, 1)), plan)

    def mix_dense(self, plan: StepPlan, scaled: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z' = a·z̃ − b·d over the whole vocabulary (d dense), in place; also |C| per row."""
        a, b = plan.a.reshape(-1, 1), plan.b.reshape(-1, 1)
        if plan.matched is None:
            return mix_and_count(scaled, d, a, b)
        plain = scaled.clone()  # the entropy to match is z̃'s, which the fused mix overwrites
        out, counts = mix_and_count(scaled, d, a, b)
        out.copy_(iv.match_entropy_rows(out, plain, b * d.float(), plan.matched_rows()))
        return out, counts

    def mix_at_candidates(
        self, plan: StepPlan, scaled: torch.Tensor, prediction: torch.Tensor, lm_head: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same mix with d computed only at the candidates (|C| rows of the LM head per row)."""
        mask = torch.isfinite(scaled)
        counts = mask.sum(dim=-1)
        width = int(counts.max()) if counts.numel() else 1  # one host read: the widest row's |C|
        return iv.steer(
            scaled,
            mask,
            prediction,
            lm_head,
            plan.a.reshape(-1, 1),
            plan.b.reshape(-1, 1),
            width=width,
            matched=plan.matched_rows(),
        ), counts

    def filter_and_mix(
        self, plan: StepPlan, logits: torch.Tensor, d: torch.Tensor | iv.HeadProduct | None
    ) -> torch.Tensor:
        """Filter and mix the plan's rows of the engine's ``logits`` in place (rows ``plan.index``);
        ``d`` holds the Distiller logits of the plan's first ``d.shape[0]`` rows (or ŷ and the LM
        head, ``intervention.HeadProduct``: the fused kernels then compute d at the candidates
        only), the rest are only filtered. Returns |C| per row. Rows with top-k take the filter
        given to the constructor; plans with entropy-matched rows take this PyTorch path too (the
        fused kernel knows only the (a, b) form), which matches at the candidates after one host
        read of the widest row's |C| (``intervention.match_entropy_rows``): slower, for measuring."""
        if plan.top_k is not None or plan.matched is not None or not FUSED_FILTER:
            d = iv.dense_logits(d, logits.shape[1])
            scaled = self.filter(plan, logits.index_select(0, plan.index))
            counts = torch.isfinite(scaled).sum(dim=-1).to(torch.int32)
            if d is not None and d.shape[0]:
                m = d.shape[0]
                a, b = plan.a[:m].reshape(-1, 1), plan.b[:m].reshape(-1, 1)
                mixed = scaled[:m] * a - b * d.float()
                if plan.matched is not None:
                    mixed = iv.match_entropy_rows(mixed, scaled[:m], b * d.float(), plan.matched_rows(m))
                scaled[:m] = mixed
            logits.index_copy_(0, plan.index, scaled)
            return counts
        work = self._work
        if work is not None and (work.rows < plan.rows or work.vocab != logits.shape[1]):
            work = None  # (``reserve`` sizes it for the engine's batch)
        return filter_and_mix(
            logits, plan.index, plan.temperature, plan.min_p, plan.top_p, plan.a, plan.b, d, work, plan.uses_top_p
        )

    def filter_and_mix_padded(
        self,
        buffers: PlanBuffers,
        rows: int,
        logits: LogitsAt,
        d: iv.HeadProduct | None,
        dense: bool = False,
        cut: bool = True,
    ) -> torch.Tensor:
        """``filter_and_mix`` on the fused kernels in the form one CUDA graph serves for every plan
        of up to ``bucket(rows)`` rows and for logits at any address: each field read from
        ``buffers`` over the whole bucket (rows past the plan's are idle: index -1), the logits
        through ``logits`` (their address on the device), the count of mixed rows from the plan's
        buffer, and ``d`` as ŷ over the bucket and the LM head (``dense``: multiplied out first, for
        rows whose candidates may be every token). Returns |C| for each of the bucket's rows."""
        if d is not None and dense:
            d = d.dense(logits.vocab)
        return launch(
            logits,
            buffers.padded("index", rows),
            buffers.padded("temperature", rows),
            buffers.padded("min_p", rows),
            buffers.padded("top_p", rows),
            buffers.padded("a", rows),
            buffers.padded("b", rows),
            d,
            self._work,
            cut,
            mixed=buffers.view("mixed", 1),
        )

    def reserve(self, rows: int, vocab: int, device: torch.device) -> None:
        """Keep the filter's working buffers for up to ``rows`` rows at fixed addresses (a GPU)."""
        if torch.device(device).type == "cuda":
            self._work = FilterWorkspace(rows, vocab, torch.device(device))
            self._overflows_seen = torch.zeros(1, dtype=torch.int32).pin_memory()

    def warm_filter(self, vocab: int, device: torch.device, d_dtype: torch.dtype, hidden: int | None = None) -> None:
        """Run the filter-and-mix on a dummy row in every form the steps use (with and without the
        top-p passes; d as a tensor, and as ŷ with a head ``hidden`` wide), so that its kernels are
        compiled before the first request (a GPU compiles Triton kernels on first use: seconds,
        not to be paid by a user)."""
        if self._work is None:
            return
        row, one = torch.zeros(1, dtype=torch.long, device=device), torch.ones(1, device=device)
        ds: list = [torch.zeros(1, vocab, device=device, dtype=d_dtype)]
        if hidden:
            yhat = torch.zeros(1, hidden, device=device, dtype=d_dtype)
            ds.append(iv.HeadProduct(yhat, torch.zeros(1, hidden, device=device, dtype=d_dtype)))
        for d in ds:
            for cut in (True, False):  # with and without the top-p passes
                z = torch.full((1, vocab), float("-inf"), device=device)
                z[0, 0] = 0.0  # one candidate, token 0 (the dummy head's one row)
                filter_and_mix(z, row, one, 0.1 * one, 0.9 * one, one, 0 * one, d, self._work, cut)

    @property
    def filter_overflows(self) -> int:
        """Boundary bins kept whole (``triton_filter``), as of the previous call (never waits)."""
        if self._work is None:
            return 0
        seen = int(self._overflows_seen[0])
        self._overflows_seen.copy_(self._work.overflows, non_blocking=True)
        return seen
