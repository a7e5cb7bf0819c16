"""What the dashboard has seen, kept as plain data: runs, their samples' tokens, the metrics series.

The screen feeds every event in here; the panes only draw. Export reads from here, so what is
written to disk is what arrived, not what happened to fit on screen. No textual import.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from esamp.events import DoneEvent, StepEvent, TokenEvent
from esamp.gpu import MemorySample
from esamp_tui.diversity import distinct_2


@dataclass
class SampleRecord:
    tokens: list[TokenEvent] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)

    @property
    def mean_novelty(self) -> float | None:
        values = [t.novelty for t in self.tokens if t.novelty is not None]
        return sum(values) / len(values) if values else None


@dataclass
class GroupRecord:
    """One group: n samples of one prompt with ESamp on or off."""

    key: str
    run_id: int
    esamp_on: bool
    beta: float
    n: int
    prompt: str
    samples: list[SampleRecord] = field(default_factory=list)
    distinct_2: float | None = None
    vendi: float | None = None

    def __post_init__(self) -> None:
        if not self.samples:
            self.samples = [SampleRecord() for _ in range(self.n)]

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def add_token(self, event: TokenEvent) -> None:
        if event.sample < len(self.samples):
            self.samples[event.sample].tokens.append(event)

    def finish(self, event: DoneEvent) -> bool:
        """Record a sample's end; True when this completed the group (diversity is then set)."""
        if event.sample >= len(self.samples) or self.samples[event.sample].finish_reason:
            return False
        self.samples[event.sample].finish_reason = event.finish_reason
        if self.finished:
            self.distinct_2 = distinct_2([s.text for s in self.samples])
            return True
        return False

    def mark_unfinished(self, reason: str) -> None:
        for sample in self.samples:
            if sample.finish_reason is None:
                sample.finish_reason = reason

    def label(self) -> str:
        return f"ESamp {'ON' if self.esamp_on else 'OFF'}" + (f" β={self.beta:g}" if self.esamp_on else "")


@dataclass
class MetricPoint:
    time: float
    step: int
    tokens_per_s: float
    loss: float | None
    port_hits: int
    candidates: float
    rows: int
    esamp: bool
    memory_used: int | None
    memory_total: int | None
    memory_kind: str


METRIC_FIELDS = list(MetricPoint.__dataclass_fields__)


class SessionRecord:
    """Every group and every step of this dashboard session (all engine restarts included)."""

    def __init__(self, max_points: int = 100_000) -> None:
        self.groups: dict[str, GroupRecord] = {}
        self.metrics: list[MetricPoint] = []
        self.max_points = max_points
        self.memory: MemorySample | None = None
        self.engine: dict = {}

    def add_group(self, group: GroupRecord) -> None:
        self.groups[group.key] = group

    def add_step(self, event: StepEvent) -> MetricPoint:
        mem = self.memory
        point = MetricPoint(
            time=event.time, step=event.step, tokens_per_s=event.tokens_per_s, loss=event.loss,
            port_hits=event.port_hits, candidates=event.candidates, rows=event.rows, esamp=event.esamp,
            memory_used=mem.used if mem else None, memory_total=mem.total if mem else None,
            memory_kind=mem.kind if mem else "na",
        )
        self.metrics.append(point)
        if len(self.metrics) > self.max_points:
            del self.metrics[: len(self.metrics) - self.max_points]
        return point

    # -- export -------------------------------------------------------------------------------

    def transcript_markdown(self) -> str:
        lines = ["# esamp transcript", ""]
        if self.engine:
            lines += [f"engine: {self.engine.get('engine', '?')} · model: {self.engine.get('model', '?')}"
                      f" · device: {self.engine.get('device', '?')}", ""]
        for group in self.groups.values():
            lines.append(f"## run {group.run_id} · {group.label()} · n={group.n}")
            lines.append("")
            lines.append("> " + group.prompt.replace("\n", "\n> "))
            lines.append("")
            if group.distinct_2 is not None:
                vendi = f" · Vendi {group.vendi:.2f}" if group.vendi is not None else ""
                lines += [f"distinct-2 {group.distinct_2:.3f}{vendi}", ""]
            for i, sample in enumerate(group.samples):
                novelty = sample.mean_novelty
                stats = f"{len(sample.tokens)} tokens, finish: {sample.finish_reason or 'running'}"
                if novelty is not None:
                    stats += f", mean novelty {novelty:.2f}"
                lines += [f"### sample {i + 1} ({stats})", "", sample.text.strip() or "_(empty)_", ""]
        return "\n".join(lines).rstrip() + "\n"

    def transcript_jsonl(self) -> str:
        """One JSON object per line: a ``group`` header, its ``token``s (with novelty), its ``done``s."""
        rows = []
        for g in self.groups.values():
            rows.append(dict(type="group", group=g.key, run=g.run_id, esamp=g.esamp_on, beta=g.beta,
                             n=g.n, prompt=g.prompt, distinct_2=g.distinct_2, vendi=g.vendi))
            for i, sample in enumerate(g.samples):
                for t in sample.tokens:
                    rows.append(t.model_dump())
                if sample.finish_reason:
                    rows.append(dict(type="done", group=g.key, sample=i,
                                     finish_reason=sample.finish_reason, tokens=len(sample.tokens)))
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)

    def metrics_csv(self, path: Path) -> None:
        with open(path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=METRIC_FIELDS)
            writer.writeheader()
            for point in self.metrics:
                writer.writerow({k: ("" if v is None else v) for k, v in point.__dict__.items()})

    def metrics_jsonl(self) -> str:
        return "".join(json.dumps(p.__dict__) + "\n" for p in self.metrics)

    def export(self, directory: Path, screenshot_svg: str | None = None) -> list[Path]:
        """Write every export file into ``directory`` (created if needed); return the paths."""
        directory.mkdir(parents=True, exist_ok=True)
        written = []

        def put(name: str, text: str) -> None:
            path = directory / name
            path.write_text(text, encoding="utf-8")
            written.append(path)

        put("transcript.md", self.transcript_markdown())
        put("transcript.jsonl", self.transcript_jsonl())
        put("metrics.jsonl", self.metrics_jsonl())
        self.metrics_csv(directory / "metrics.csv")
        written.append(directory / "metrics.csv")
        if screenshot_svg is not None:
            put("screenshot.svg", screenshot_svg)
        return written


def default_export_dir() -> Path:
    return Path.cwd() / time.strftime("esamp-export-%Y%m%d-%H%M%S")
