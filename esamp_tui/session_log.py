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

from esamp.core.config import SamplingConfig, Steering, update_config
from esamp.events import DoneEvent, StepEvent, TokenEvent
from esamp.platform.gpu import MemorySample
from esamp_tui.diversity import distinct_2
from esamp_tui.screenshot import ScreenshotError, offline_svg, svg_to_png
from esamp_tui.worker import run_group_key


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


# How a group ended when it did not run to its end, as the history line marks it.
INTERRUPTIONS = {"abort": "aborted", "cut": "cut off", "error": "failed"}


@dataclass
class GroupRecord:
    """One group: n samples of one prompt, with the settings the worker ran it with."""

    key: str
    run_id: int
    prompt: str
    steering: Steering
    sampling: SamplingConfig
    samples: list[SampleRecord] = field(default_factory=list)
    distinct_2: float | None = None
    vendi: float | None = None
    interrupted: str | None = None  # a key of INTERRUPTIONS, once the run was stopped early
    started: float = field(default_factory=time.monotonic)  # when it was sent (or the engine became ready)
    ended: float | None = None  # when its last sample ended

    def __post_init__(self) -> None:
        if not self.samples:
            self.samples = [SampleRecord() for _ in range(self.n)]

    @property
    def esamp_on(self) -> bool:
        return self.steering.enabled

    @property
    def n(self) -> int:
        return self.sampling.n

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    @property
    def complete(self) -> bool:
        """Every sample ran to its stop token or its token limit: comparable with other runs."""
        return self.interrupted is None and all(s.finish_reason in ("stop", "length") for s in self.samples)

    @property
    def token_count(self) -> int:
        return sum(len(s.tokens) for s in self.samples)

    def tokens_per_s(self, now: float | None = None) -> float | None:
        """The run's rate: its tokens over its time so far (to its end, once it ended).

        Not the engine's latest windowed figure, which falls as the run's samples finish.
        None before its first token.
        """
        if not self.token_count:
            return None
        elapsed = (self.ended if self.ended is not None else time.monotonic() if now is None else now) - self.started
        return self.token_count / max(elapsed, 1e-3)

    @property
    def mean_tokens(self) -> float:
        return sum(len(s.tokens) for s in self.samples) / max(len(self.samples), 1)

    def add_token(self, event: TokenEvent) -> None:
        if event.sample < len(self.samples):
            self.samples[event.sample].tokens.append(event)

    def finish(self, event: DoneEvent) -> bool:
        """Record a sample's end; True when this completed the group (diversity is then set)."""
        if event.sample >= len(self.samples) or self.samples[event.sample].finish_reason:
            return False
        self.samples[event.sample].finish_reason = event.finish_reason
        if event.finish_reason in ("abort", "error") and self.interrupted is None:
            self.interrupted = event.finish_reason
        if self.finished:
            self.ended = time.monotonic()
            self.distinct_2 = distinct_2([s.text for s in self.samples])
            return True
        return False

    def stop(self, why: str) -> bool:
        """End the samples still running (``why``: a key of INTERRUPTIONS); True if any were."""
        open_samples = [s for s in self.samples if s.finish_reason is None]
        for sample in open_samples:
            sample.finish_reason = "error" if why == "error" else "abort"
        if open_samples:
            self.interrupted = self.interrupted or why
            self.ended = time.monotonic()
            self.distinct_2 = distinct_2([s.text for s in self.samples])
        return bool(open_samples)

    def label(self) -> str:
        if not self.esamp_on:
            return "ESamp OFF"
        mix = "" if self.steering.mix == Steering.model_fields["mix"].default else f" {self.steering.mix}"
        return f"ESamp ON β={self.steering.beta:g}{mix}"

    def comparable(self, other: GroupRecord) -> bool:
        """Same prompt and sampling, both complete: only then do their numbers say something
        about the steering (distinct-2 of a 15-token run is not that of a 128-token one)."""
        return self.complete and other.complete and self.prompt == other.prompt and self.sampling == other.sampling


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
        self.exported: list[Path] = []  # the files of the last export

    def add_group(self, group: GroupRecord) -> None:
        self.groups[group.key] = group

    def new_run(
        self, run_id: int, prompt: str, steering: Steering, sampling: SamplingConfig, compare: bool
    ) -> list[GroupRecord]:
        """The groups of a new run (ESamp off and on to compare), as the worker names them."""
        modes = (False, True) if compare else (steering.enabled,)
        groups = [
            GroupRecord(run_group_key(run_id, on), run_id, prompt, update_config(steering, enabled=on), sampling)
            for on in modes
        ]
        for group in groups:
            self.add_group(group)
        return groups

    def running(self) -> list[GroupRecord]:
        return [g for g in self.groups.values() if not g.finished]

    def stop_running(self, why: str) -> list[GroupRecord]:
        """End every running group early (``why``: a key of INTERRUPTIONS); return them."""
        return [g for g in self.groups.values() if g.stop(why)]

    def ended(self) -> list[GroupRecord]:
        return [g for g in self.groups.values() if g.finished]

    def engine_ready(self, now: float | None = None) -> None:
        """Runs sent before the engine was up start their clock now: loading is not decoding."""
        now = time.monotonic() if now is None else now
        for group in self.running():
            group.started = max(group.started, now)

    def run_rates(self, now: float | None = None) -> dict[bool, float]:
        """ESamp off / on → tokens/s of the latest run of each that has tokens, the latest last."""
        latest: dict[bool, GroupRecord] = {}
        for group in self.groups.values():
            if group.token_count:
                latest.pop(group.esamp_on, None)
                latest[group.esamp_on] = group
        return {on: group.tokens_per_s(now) for on, group in latest.items()}

    def baseline(self, group: GroupRecord) -> GroupRecord | None:
        """The latest group before ``group`` (in a compare run: its ESamp-off sibling) that was
        steered otherwise and can be compared with it."""
        keys = list(self.groups)
        for key in reversed(keys[: keys.index(group.key)] if group.key in self.groups else keys):
            other = self.groups[key]
            if other.steering != group.steering and group.comparable(other):
                return other
        return None

    def add_step(self, event: StepEvent, memory: MemorySample | None = None) -> MetricPoint:
        """One engine step, with the newest memory reading (kept for the steps that follow)."""
        self.memory = memory or self.memory
        mem = self.memory
        point = MetricPoint(
            time=event.time,
            step=event.step,
            tokens_per_s=event.tokens_per_s,
            loss=event.loss,
            port_hits=event.port_hits,
            candidates=event.candidates,
            rows=event.rows,
            esamp=event.esamp,
            memory_used=mem.used if mem else None,
            memory_total=mem.total if mem else None,
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
            lines += [
                f"engine: {self.engine.get('engine', '?')} · model: {self.engine.get('model', '?')}"
                f" · device: {self.engine.get('device', '?')}",
                "",
            ]
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
            rows.append(
                dict(
                    type="group",
                    group=g.key,
                    run=g.run_id,
                    prompt=g.prompt,
                    steering=g.steering.model_dump(),
                    sampling=g.sampling.model_dump(),
                    interrupted=g.interrupted,
                    distinct_2=g.distinct_2,
                    vendi=g.vendi,
                )
            )
            for i, sample in enumerate(g.samples):
                for t in sample.tokens:
                    rows.append(t.model_dump())
                if sample.finish_reason:
                    rows.append(
                        dict(
                            type="done",
                            group=g.key,
                            sample=i,
                            finish_reason=sample.finish_reason,
                            tokens=len(sample.tokens),
                        )
                    )
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)

    def metrics_csv(self, path: Path) -> None:
        with open(path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=METRIC_FIELDS)
            writer.writeheader()
            for point in self.metrics:
                writer.writerow({k: ("" if v is None else v) for k, v in point.__dict__.items()})

    def metrics_jsonl(self) -> str:
        return "".join(json.dumps(p.__dict__) + "\n" for p in self.metrics)

    def export(self, directory: Path, screenshot_svg: str | None = None) -> tuple[list[Path], str]:
        """Write every export file into ``directory`` (created if needed).

        Returns the paths written and a note: empty, or why the PNG beside the SVG screenshot
        could not be rendered here (``esamp_tui.screenshot``); everything else is written anyway.
        """
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
        note = ""
        if screenshot_svg is not None:
            put("screenshot.svg", offline_svg(screenshot_svg))
            try:
                png = svg_to_png(screenshot_svg)
            except ScreenshotError as exc:
                note = exc.user_text()
            else:
                (directory / "screenshot.png").write_bytes(png)
                written.append(directory / "screenshot.png")
        self.exported = written
        return written, note


def default_export_dir() -> Path:
    return Path.cwd() / time.strftime("esamp-export-%Y%m%d-%H%M%S")


def history_line(group: GroupRecord, baseline: GroupRecord | None) -> tuple[str, str]:
    """(what the run measured, its mark) for the history above the charts.

    The mark says why a run is not compared (it was aborted, cut off by the next run, failed),
    or what it is compared with: the latest run of the same prompt and sampling steered the
    other way (``SessionRecord.baseline``).
    """
    d2 = "n/a" if group.distinct_2 is None else f"{group.distinct_2:.3f}"
    text = f"run {group.run_id} · {group.label()} · n={group.n} · {group.mean_tokens:.0f} tok/sample · distinct-2 {d2}"
    if group.vendi is not None:
        text += f" · Vendi {group.vendi:.2f}"
    if group.interrupted:
        return text, f"{INTERRUPTIONS[group.interrupted]}: not compared"
    if baseline is None or group.distinct_2 is None or baseline.distinct_2 is None:
        return text, ""
    delta = f"distinct-2 {group.distinct_2 - baseline.distinct_2:+.3f}"
    if group.vendi is not None and baseline.vendi is not None:
        delta += f", Vendi {group.vendi - baseline.vendi:+.2f}"
    return text, f"{delta} vs run {baseline.run_id} ({baseline.label()})"
