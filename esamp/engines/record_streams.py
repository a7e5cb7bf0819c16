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

import math
from collections import defaultdict
from dataclasses import dataclass, field

from esamp.engines.base import EngineBase, Group, StepStats
from esamp.events import Event


@dataclass
class RecordedGroup(Group):
    request_ids: list[str] = field(default_factory=list)  # the requests carrying its samples
    arrived: list[list[int]] = field(default_factory=list)  # sample → token ids received so far
    fed: list[int] = field(default_factory=list)  # sample → tokens handed to GroupStream
    final: dict[int, str] = field(default_factory=dict)  # sample → its finish reason
    records: dict[int, list[tuple[int, int, float]]] = field(default_factory=lambda: defaultdict(list))
    latest: dict[tuple[int, int], int] = field(default_factory=dict)  # (sample, gen idx) → step


def finish_reason(reason: str | None) -> str:
    """vLLM's finish reason as an event's (anything unknown is an error)."""
    if reason in ("stop", "length", "abort"):
        return reason
    return "error" if reason else "stop"


class RecordedEngine(EngineBase):
    """The record-and-token bookkeeping; subclasses receive tokens into ``arrived``/``final`` and
    records through ``_file``, then call ``_advance`` per group."""

    def _file(self, rec: dict, stats: StepStats) -> None:
        """Sort one engine step's record into its groups."""
        per_group: dict[str, list[float]] = defaultdict(list)
        rows = rec["rows"] if "rows" in rec else zip(*rec["columns"].values())
        for group, sample, gen_idx, error, cands in rows:
            g = self.groups.get(group)
            if g is None or not g.steered:
                continue
            g.records[rec["step"]].append((sample, gen_idx, error))
            g.latest[(sample, gen_idx)] = rec["step"]  # a later prefill chunk supersedes
            per_group[group].append(cands)
            stats.port_hits += 1
        for cands in per_group.values():
            stats.candidates.append(sum(cands) / len(cands))
        for group, loss in rec["loss"].items():  # in step order: records are filed as they come
            if math.isfinite(loss):
                stats.add_loss(group, loss)

    def _advance(self, g: RecordedGroup, all_back: bool) -> list[Event]:
        events: list[Event] = []
        if not g.steered:
            # One engine step per call: every new token is this step's (delta outputs).
            unit = [
                (s, g.fed[s], g.arrived[s][g.fed[s]], None) for s in range(g.sampling.n) if g.fed[s] < len(g.arrived[s])
            ]
            while unit:
                events += self._feed(g, unit, steered=False)
                unit = [
                    (s, g.fed[s], g.arrived[s][g.fed[s]], None)
                    for s in range(g.sampling.n)
                    if g.fed[s] < len(g.arrived[s])
                ]
            return events + self._finish_ready(g)
        for step in sorted(g.records):
            rows = [(s, k, e) for s, k, e in g.records[step] if g.latest.get((s, k)) == step]
            unit, waiting = [], False
            for s, k, e in sorted(rows):
                if k < g.fed[s]:
                    continue  # already fed (duplicate)
                if k < len(g.arrived[s]):
                    unit.append((s, k, g.arrived[s][k], e))
                elif s not in g.final:
                    waiting = True
            if waiting:
                break
            del g.records[step]
            if unit:
                events += self._feed(g, unit, steered=True)
        # Samples that ended with tokens no record will ever cover (a row the processor could not
        # steer: counted in its counters). Only once every engine step has reported back.
        for s in range(g.sampling.n):
            if not all_back or s not in g.final:
                continue
            if not any(s == r[0] for rows in g.records.values() for r in rows):
                while g.fed[s] < len(g.arrived[s]):
                    events += self._feed(g, [(s, g.fed[s], g.arrived[s][g.fed[s]], None)], steered=True)
        return events + self._finish_ready(g)

    def _feed(self, g: RecordedGroup, unit: list[tuple[int, int, int, float | None]], steered: bool) -> list[Event]:
        """One engine step of a group: release the inputs' novelty, then take the new tokens."""
        events: list[Event] = []
        inputs = [(s, e) for s, k, _, e in unit if k >= 1]
        known = [(s, e) for s, e in inputs if e is not None and math.isfinite(e)]
        unknown = [s for s, e in inputs if not (e is not None and math.isfinite(e))]
        if steered and known:
            events += g.stream.novelties([s for s, _ in known], [e for _, e in known])
        if unknown or (inputs and not steered):
            events += g.stream.novelties(unknown or [s for s, _ in inputs], None)
        for s, k, token, _ in unit:
            g.fed[s] = k + 1
            if s in g.stream.finished:
                continue
            if g.stream.sampled(s, token):
                events += g.stream.finish(s, "stop")
            elif s in g.final and g.fed[s] >= len(g.arrived[s]):
                events += g.stream.finish(s, g.final[s])
        return events

    def _finish_ready(self, g: RecordedGroup) -> list[Event]:
        events: list[Event] = []
        for s, reason in g.final.items():
            if s not in g.stream.finished and g.fed[s] >= len(g.arrived[s]):
                events += g.stream.finish(s, reason)
        return events
