"""Engines whose novelty arrives as step records: the in-process vLLM engine and a served endpoint's client.

Their samples' tokens come in one stream (vLLM's delta outputs, or an HTTP stream) and each
token's novelty in another: the step records of the ESamp logits processor, which say which
engine step sampled which (sample, generation index) and that step's Distiller error. A token is
handed to ``GroupStream`` once the record of the step where it was the input is back (its
novelty), one engine step at a time and in the order the reference engine uses: first the
novelties of the step's inputs, then its new tokens. If a record is not back yet (its device copy
is still running), its tokens wait; nothing is guessed. A sample the processor could not steer
(every slot held) ends without novelty once every record has been read.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import groupby, islice
from math import isfinite
from operator import lt

from esamp.engines.base import EngineBase, Group, StepStats
from esamp.events import Event

Run = tuple[Sequence[int], Sequence[int], Sequence[float]]  # a record's rows of one group: samples, gen idxs, errors


@dataclass
class RecordedGroup(Group):
    request_ids: list[str] = field(default_factory=list)  # the requests carrying its samples
    arrived: list[list[int]] = field(default_factory=list)  # sample → token ids received so far
    fed: list[int] = field(default_factory=list)  # sample → tokens handed to GroupStream
    final: dict[int, str] = field(default_factory=dict)  # sample → its finish reason
    # step → its rows of this group, as runs of columns (samples, gen idxs, errors) as filed
    records: dict[int, list[Run]] = field(default_factory=lambda: defaultdict(list))
    # The row that counts for a (sample, gen idx) is the last filed (a later prefill chunk
    # supersedes an earlier). A run of rows whose gen idx are all above every one filed before
    # (``top``; a decode step) has none filed before: only ``first`` notes the step of each gen
    # idx. Keys filed when they may not be new are in ``latest`` (key → step), and the steps whose
    # rows they superseded in ``superseded``: only those steps' rows are sifted (``_advance``).
    latest: dict[tuple[int, int], int] = field(default_factory=dict)
    top: int = -1  # the highest gen idx filed
    first: dict[int, int] = field(default_factory=dict)  # gen idx → the step that filed it above ``top``
    superseded: set[int] = field(default_factory=set)


def finish_reason(reason: str | None) -> str:
    """vLLM's finish reason as an event's (anything unknown is an error)."""
    if reason in ("stop", "length", "abort"):
        return reason
    return "error" if reason else "stop"


def _refile(g: RecordedGroup, step: int, samples, gens) -> None:
    """File keys that may have been filed before: the earlier step's row of each, if it is still
    waiting, no longer counts (``RecordedGroup.latest``)."""
    latest, records = g.latest, g.records
    for s, k in zip(samples, gens):
        old = latest.get((s, k))
        if old is None:  # filed before at most once, in a run above ``top``
            earlier = g.first.get(k, step)
            if earlier != step and any((s, k) in zip(run[0], run[1]) for run in records.get(earlier, ())):
                old = earlier
        if old is not None and old != step:
            g.superseded.add(old)
        latest[(s, k)] = step
    g.top = max(g.top, max(gens))


def _ascending(samples: Sequence[int]) -> bool:
    """Whether every sample comes once, in order (a run's rows are then sorted as they are)."""
    return all(map(lt, samples, islice(samples, 1, None)))


class RecordedEngine(EngineBase):
    """The record-and-token bookkeeping; subclasses receive tokens into ``arrived``/``final`` and
    records through ``_file``, then call ``_advance`` per group.

    This process handles every row of every engine step (256 a step at 32 prompts of n=8), so the
    rows are handled a run of one group's rows at a time where they can be: a record's rows come
    mostly grouped (a group's requests sit together in vLLM's batch), a decode step's gen idxs are
    new, and a run of samples in order is sorted already. Rows that are not so take the long way,
    to the same events."""

    def _file(self, rec: dict, stats: StepStats) -> None:
        """Sort one engine step's record into its groups."""
        step = rec["step"]
        if "rows" in rec:
            cols = tuple(zip(*rec["rows"])) or ((),) * 5
        else:
            cols = tuple(rec["columns"].values())
        groups, samples, generated, errors, cands = cols
        per_group: dict[str, list[float]] = {}
        hits, at = 0, 0
        for group, run in groupby(groups):
            start, at = at, at + len(list(run))
            g = self.groups.get(group)
            if g is None or not g.steered:
                continue
            ss, ks = samples[start:at], generated[start:at]
            g.records[step].append((ss, ks, errors[start:at]))
            if min(ks) > g.top:  # every key new (a decode step): nothing to supersede
                g.first.update(dict.fromkeys(ks, step))
                g.top = max(ks)
            else:
                _refile(g, step, ss, ks)
            seen = per_group.get(group)
            if seen is None:
                per_group[group] = list(cands[start:at])
            else:
                seen.extend(cands[start:at])
            hits += at - start
        stats.port_hits += hits
        for values in per_group.values():
            stats.candidates.append(sum(values) / len(values))
        for group, loss in rec["loss"].items():  # in step order: records are filed as they come
            if isfinite(loss):
                stats.add_loss(group, loss)

    def _advance(self, g: RecordedGroup, all_back: bool) -> list[Event]:
        events: list[Event] = []
        fed, arrived = g.fed, g.arrived
        if not g.steered:
            # One engine step per call: every new token is this step's (delta outputs).
            samples = range(g.sampling.n)
            while True:
                unit = []
                for s in samples:
                    k = fed[s]
                    got = arrived[s]
                    if k < len(got):
                        unit.append((s, k, got[k], None))
                if not unit:
                    break
                events += self._feed(g, unit, steered=False)
            return events + self._finish_ready(g) if g.final else events
        records, final = g.records, g.final
        for step in sorted(records):
            runs = records[step]
            if len(runs) == 1 and step not in g.superseded and _ascending(runs[0][0]):
                rows = zip(*runs[0])  # in order already: one run, every sample once, in order
            else:
                rows = [row for run in runs for row in zip(*run)]
                if step in g.superseded:
                    latest = g.latest
                    rows = [(s, k, e) for s, k, e in rows if latest.get((s, k), step) == step]
                rows = sorted(rows)
            unit, waiting = [], False
            for s, k, e in rows:
                if k < fed[s]:
                    continue  # already fed (duplicate)
                got = arrived[s]
                if k < len(got):
                    unit.append((s, k, got[k], e))
                elif s not in final:
                    waiting = True
                    break
            if waiting:
                break
            del records[step]
            g.superseded.discard(step)
            if unit:
                events += self._feed(g, unit, steered=True)
        # Samples that ended with tokens no record will ever cover (a row the processor could not
        # steer: counted in its counters). Only once every engine step has reported back.
        if all_back and final:
            for s in range(g.sampling.n):
                if s not in final:
                    continue
                if not any(s in run[0] for runs in records.values() for run in runs):
                    while fed[s] < len(arrived[s]):
                        events += self._feed(g, [(s, fed[s], arrived[s][fed[s]], None)], steered=True)
        return events + self._finish_ready(g) if final else events

    def _feed(self, g: RecordedGroup, unit: list[tuple[int, int, int, float | None]], steered: bool) -> list[Event]:
        """One engine step of a group: release the inputs' novelty, then take the new tokens."""
        known, errors, unknown = [], [], []  # inputs (gen idx >= 1) with a finite error, and without
        for s, k, _, e in unit:
            if k >= 1:
                if e is not None and isfinite(e):
                    known.append(s)
                    errors.append(e)
                else:
                    unknown.append(s)
        events: list[Event] = []
        stream = g.stream
        if steered and known:
            events += stream.novelties(known, errors)
        if unknown:
            events += stream.novelties(unknown, None)
        elif known and not steered:
            events += stream.novelties(known, None)
        fed, arrived, final, finished = g.fed, g.arrived, g.final, stream.finished
        for s, k, token, _ in unit:
            fed[s] = k + 1
            if s in finished:
                continue
            if stream.sampled(s, token):
                events += stream.finish(s, "stop")
            elif s in final and k + 1 >= len(arrived[s]):
                events += stream.finish(s, final[s])
        return events

    def _finish_ready(self, g: RecordedGroup) -> list[Event]:
        events: list[Event] = []
        for s, reason in g.final.items():
            if s not in g.stream.finished and g.fed[s] >= len(g.arrived[s]):
                events += g.stream.finish(s, reason)
        return events
