"""Requests as ESamp rows, and prompt groups with their Distiller slots. No vLLM import.

A logits-processor adapter turns each request vLLM adds to its batch into a ``RequestRow`` (or
None when the request is not ESamp's) with ``request_row``, keeps them by its own batch index, and
hands them to ``esamp.engines.vllm.steering``. Group state is keyed by the group, never by a row.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from esamp.core import payload as pl
from esamp.core.config import EsampConfig, Filters, Steering
from esamp.core.distiller import SlotLedger
from esamp.errors import EsampError

IDLE_RELEASE_STEPS = 256  # a group with no row in the batch this long gives its slot back


@dataclass(frozen=True)
class RequestRow:
    group: str
    sample: int
    steering: Steering | None  # None: not steered (the engine runs without ESamp)
    filters: Filters
    output_ids: list[int]  # the request's generated ids (a live list): its length is the
    # generation index of the token sampled this step
    records: bool
    n: int | None  # samples in the row's group, when the request said


def request_row(
    extra_args, seed: int | None, output_ids: list[int], groups: Groups, config: EsampConfig | None, record_all: bool
) -> RequestRow | None:
    """The row of a request vLLM adds (``extra_args`` and ``seed`` of its ``SamplingParams``), or
    None when ``settings.prepare`` did not make it an ESamp request."""
    if not extra_args:
        return None
    try:
        payload = pl.decode(extra_args)  # once per child: vLLM hands each its own copy
    except (EsampError, TypeError):
        return None  # validate_params refused it; it never runs
    if payload is None or payload.filters is None or payload.group is None:
        return None  # not prepared: vLLM applies the request's filters itself
    group = payload.group
    if payload.sample is not None:
        sample = payload.sample
    elif payload.seed is not None and seed is not None:
        sample = seed - payload.seed  # child i of a seeded request has seed + i
    else:
        sample = groups.sample_of(group, output_ids)
    steering = payload.steering_over(config.steering) if config is not None else None
    return RequestRow(
        group, sample, steering, payload.filters, output_ids, records=record_all or bool(payload.records), n=payload.n
    )


class Groups:
    """Prompt groups: their Distiller slots, when each was last in a batch, its samples."""

    def __init__(self, bank: SlotLedger | None) -> None:
        self.bank = bank  # the Distiller bank, or (a tensor-parallel worker without it) its slot ledger
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

    def arrived(self, row: RequestRow) -> None:
        self.samples_seen[row.group].add(row.sample)

    def complete(self, row: RequestRow) -> bool:
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
