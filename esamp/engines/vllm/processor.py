"""``EsampLogitsProcessor``: ESamp inside vLLM's sampler, through the V1 logits-processor interface.

Per step, for every row whose request carries ESamp settings (``extra_args["esamp"]``, on):

1. take this step's tapped rows from the model (``state.STATE``; logits-row order),
2. predict the target from the source with the group's Distiller slot; the row error e is the
   raw novelty of the token that was this row's input,
3. steer: z̃ = z/T, C = the request's own min-p/top-k/top-p on z̃ exactly as vLLM's sampler
   forms it (``esamp.intervention.candidate_mask`` at full width: no host read), z' = mix(z̃, d)
   on C, −∞ elsewhere (``esamp.intervention``); the request handed vLLM neutral filters, so
   vLLM only draws from z',
4. train one optimizer step per slot on the step's rows; the prediction used for steering is
   the one from before the update, as in the reference engine
   (``DistillerBank.predict_and_train`` takes both from one forward pass when every row trains).

Rows are mapped fresh each step from ``BatchUpdate`` (removed → added → moved); state is keyed by
group, never by row. A group's slot is allocated when its first request joins and freed when the client releases the
group (``drain(release=...)``), so a preempted request that leaves the batch and comes back keeps
its group's Distiller.

Results leave through ``drain``: one record per step (rows with group, sample, generation
index and error; per-group loss and candidate counts; port hits). Device values are copied
without blocking and read only once their copy has finished, so draining never stalls the GPU.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field

import torch

from esamp import intervention as iv
from esamp.distiller import DistillerBank, RowLayout
from esamp.engines.vllm.settings import KEY, parse_request_settings, vllm_filters
from esamp.engines.vllm.state import STATE

try:  # vLLM ≤ 0.30: the V1 interface (the MRv2 one of ≥ 0.31 would need a second adapter)
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
except ImportError as exc:  # pragma: no cover - depends on the installed vLLM
    raise ImportError(f"this vLLM has no V1 logits-processor interface: {exc}") from exc

# Candidate-only gathers read |C|·H LM-head entries per row; when that exceeds this many bytes
# (flat distributions, e.g. random weights) one [R, V] product is cheaper and uses less memory.
GATHER_BYTES = 256 * 2**20


@dataclass
class _Row:
    settings: dict
    output_ids: list[int]  # live reference to the request's generated ids


@dataclass
class _StepRecord:
    step: int
    meta: list[tuple[str, int, int]]  # (group, sample, generation index) per steered row
    errors: torch.Tensor  # [n] raw row error
    candidates: torch.Tensor  # [n] |C| per row
    loss_groups: list[str] = field(default_factory=list)
    losses: torch.Tensor | None = None  # [U] per-slot loss before the step's update
    event: object = None  # a CUDA event once the copies above are queued
    stash_miss: bool = False


def steer_rows(scaled: torch.Tensor, mask: torch.Tensor, prediction: torch.Tensor,
               lm_head: torch.Tensor, beta: torch.Tensor, kind: str, path: str = "auto") -> torch.Tensor:
    """``esamp.intervention.steer`` for one step's rows, choosing how to get d.

    ``auto``: small candidate sets go through the core's candidate-only path unchanged; when the
    widest row's candidates would need more than ``GATHER_BYTES`` of gathered LM-head rows, d
    comes from one [R, V] product instead. ``full``: always the product, with no host read.
    Both give the same z' on C up to matmul rounding.
    """
    rows, vocab = scaled.shape
    if path == "auto":
        width = int(mask.sum(dim=-1).max()) if rows else 0
        if width * rows * lm_head.shape[1] * lm_head.element_size() <= GATHER_BYTES:
            return iv.steer(scaled, mask, prediction, lm_head, beta, kind, width=width)
    d = (prediction.to(lm_head.dtype) @ lm_head[:vocab].t()).float()  # [R, V]
    return iv.mix(scaled, d, beta, kind).masked_fill(~mask, iv.NEG_INF)


@dataclass
class _Plan:
    settings: list[dict]
    outputs: list[list[int]]
    idx: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    beta: torch.Tensor
    layout: RowLayout
    kinds: list[tuple[str, torch.Tensor]]
    train: tuple[torch.Tensor, RowLayout, list[str]] | None


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
        self.trace: list[dict] | None = None  # tests set a list to see every steered step
        self._cached_plan: _Plan | None = None
        self._cached_plan_rows = -1
        # How d is formed: "auto" picks candidate-only gathers or one [R, V] product from the
        # widest candidate set (a host read); "full" always takes the product and never waits
        # for the GPU, which is what keeps the sampler asynchronous on CUDA.
        self.head_path = os.environ.get("ESAMP_HEAD_PATH") or ("full" if self.device.type == "cuda" else "auto")
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

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        R = logits.shape[0]
        taps = STATE.take_taps()
        if not self.rows or self.bank is None:
            return logits
        plan = self._plan(R)
        if plan is None:
            return logits
        self.step += 1
        rows = plan.settings
        scaled = iv.scale_logits(logits.index_select(0, plan.idx), plan.temperature)
        mask = iv.candidate_mask(scaled, plan.top_k, plan.top_p, plan.min_p, width=scaled.shape[1])
        meta = [(s["group"], s["sample"], len(out)) for s, out in zip(rows, plan.outputs)]
        if taps is None or taps.source.shape[0] != R:
            # No taps for this step (should not happen): keep the request's own filters exact,
            # but do not steer or train, and say so in the counters.
            logits.index_copy_(0, plan.idx, iv.filtered_logits(scaled, mask))
            self.counters["stash_miss"] += 1
            return logits

        x = taps.source.index_select(0, plan.idx)
        y = taps.target.index_select(0, plan.idx)
        losses = None
        if plan.train is not None and plan.train[0].numel() == len(rows):
            # Every row trains: one forward pass gives the (pre-update) prediction and the step.
            prediction, errors, losses = self.bank.predict_and_train(x, y, plan.layout)
        else:
            prediction = self.bank.predict(x, plan.layout)
            errors = DistillerBank.row_error(prediction, y)
        lm_head = STATE.model.esamp_lm_head()
        if len(plan.kinds) == 1:
            out = steer_rows(scaled, mask, prediction, lm_head, plan.beta, plan.kinds[0][0], self.head_path)
        else:
            out = torch.empty_like(scaled)
            for kind, j in plan.kinds:
                out.index_copy_(0, j, steer_rows(scaled.index_select(0, j), mask.index_select(0, j),
                                                 prediction.index_select(0, j), lm_head,
                                                 plan.beta.index_select(0, j), kind, self.head_path))
        if self.trace is not None:
            self.trace.append(dict(meta=meta, settings=rows, logits=logits.index_select(0, plan.idx).clone(),
                                   source=x.clone(), target=y.clone(), prediction=prediction.clone(),
                                   steered=out.clone(), head_path=self.head_path))
        logits.index_copy_(0, plan.idx, out.to(logits.dtype))
        self.counters["port_hits"] += len(rows)

        record = _StepRecord(step=self.step, meta=meta, errors=errors,
                             candidates=mask.sum(dim=-1).float())
        if plan.train is not None:
            t, layout, groups = plan.train
            if losses is None:
                losses = self.bank.train_step(x.index_select(0, t), y.index_select(0, t), layout)
            record.losses, record.loss_groups = losses, groups
            self.counters["train_steps"] += 1
        self._queue(record)
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
        kinds = sorted({s["mix"] for s in rows})
        train = [j for j, s in enumerate(rows) if s["train"]]
        with torch.inference_mode(False):
            plan = _Plan(
                settings=rows,
                outputs=[r.output_ids for _, r in steered],
                idx=self._tensor([i for i, _ in steered], torch.long),
                temperature=self._tensor([s["temperature"] for s in rows]),
                top_k=self._tensor([s["top_k"] for s in rows], torch.long),
                top_p=self._tensor([s["top_p"] for s in rows]),
                min_p=self._tensor([s["min_p"] for s in rows]),
                beta=self._tensor([s["beta"] for s in rows]),
                layout=self._layout(slots),
                kinds=[(k, self._tensor([j for j, s in enumerate(rows) if s["mix"] == k], torch.long))
                       for k in kinds],
                train=(self._tensor(train, torch.long), self._layout([slots[j] for j in train]),
                       list(dict.fromkeys(rows[j]["group"] for j in train))) if train else None,
            )
        self._cached_plan, self._cached_plan_rows = plan, R
        return plan

    # -- results -----------------------------------------------------------------------------

    def _queue(self, record: _StepRecord) -> None:
        """Start the device→host copies of a record without waiting for them."""
        nb = self.device.type == "cuda"
        record.errors = record.errors.to("cpu", non_blocking=nb)
        record.candidates = record.candidates.to("cpu", non_blocking=nb)
        if record.losses is not None:
            record.losses = record.losses.to("cpu", non_blocking=nb)
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
            errors, cands = r.errors.tolist(), r.candidates.tolist()
            steps.append({
                "step": r.step,
                "rows": [(g, s, k, e, c) for (g, s, k), e, c in zip(r.meta, errors, cands)],
                "loss": dict(zip(r.loss_groups, r.losses.tolist())) if r.losses is not None else {},
            })
        return {
            "steps": steps,
            "pending": len(self.records),  # steps whose device copies are still running
            "counters": dict(self.counters),
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
                         self._tensor(host.row_pos.tolist(), torch.long), host.width)


class _SamplingView:
    """The fields of ``SamplingConfig`` that ``vllm_filters`` reads, from request settings."""

    def __init__(self, settings: dict) -> None:
        self.temperature = settings["temperature"]
        self.top_p, self.top_k, self.min_p = settings["top_p"], settings["top_k"], settings["min_p"]
