"""Is this run far slower than this machine usually is? A small record of recent tokens/s.

On a shared CPU the reference engine can run many times slower than usual while another job
holds the cores, with nothing on screen saying so. The dashboard keeps, per engine, model and
device, the median tokens/s of the last ``KEEP`` runs at each batch shape (rows decoded per step,
ESamp on or off), in ``$ESAMP_CACHE_DIR/tui-speed.json``; while a run streams, ``SpeedWatch``
compares its median with that record and says when it is below ``SLOW_FRACTION`` of it.

Like with like: tokens/s grows with the rows in a step and drops with ESamp on, so only steps of
the same shape are compared. The first ``WARMUP_STEPS`` steps of a run (prefill, a cold cache)
and runs shorter than that are left out.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from esamp.engines.models import cache_dir
from esamp.events import ReadyEvent, StepEvent

SLOW_FRACTION = 0.5  # "far below": under half the usual rate
WARMUP_STEPS = 4
MIN_STEPS = 8  # steps of one shape before a run's median means something
KEEP = 20  # runs remembered per shape


def record_file() -> Path:
    return cache_dir() / "tui-speed.json"


def machine_key(ready: ReadyEvent) -> str:
    return f"{ready.engine} · {ready.model} · {ready.device}"


def shape_key(rows: int, esamp: bool) -> str:
    return f"{rows} rows, ESamp {'on' if esamp else 'off'}"


@dataclass
class SpeedRecord:
    """Recent run medians of one engine/model/device, by step shape."""

    path: Path
    machine: str
    runs: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def load(cls, ready: ReadyEvent, path: Path | None = None) -> SpeedRecord:
        path = path or record_file()
        machine = machine_key(ready)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            runs = {k: [float(v) for v in vs][-KEEP:] for k, vs in data.get(machine, {}).items()}
        except (OSError, ValueError, TypeError, AttributeError):
            runs = {}  # no record yet, or one this version cannot read: start a new one
        return cls(path, machine, runs)

    def usual(self, shape: str) -> float | None:
        values = self.runs.get(shape)
        return statistics.median(values) if values else None

    def add(self, shape: str, tokens_per_s: float) -> None:
        self.runs[shape] = (self.runs.get(shape, []) + [round(tokens_per_s, 2)])[-KEEP:]

    def save(self) -> None:
        """Merge into the file (other models' records stay); a failure is ignored."""
        try:
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
                data = data if isinstance(data, dict) else {}
            except (OSError, ValueError):
                data = {}
            data[self.machine] = self.runs
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")
            tmp.replace(self.path)
        except OSError:
            pass


@dataclass(frozen=True)
class Slow:
    """The current run is far below the usual rate for its shape."""

    now: float
    usual: float

    def text(self) -> str:
        return f"slow: {self.now:,.0f} tok/s, usually {self.usual:,.0f}"

    def explain(self, engine: str) -> str:
        hint = " Is another job using the CPU? Try --threads 1." if engine == "reference" else ""
        return (
            f"This run is far slower than this machine usually is ({self.now:,.0f} tok/s, "
            f"usually {self.usual:,.0f} at this batch size).{hint}"
        )


class SpeedWatch:
    """Collects one run's step rates by shape; compares them with the record."""

    def __init__(self, record: SpeedRecord) -> None:
        self.record = record
        self.steps: dict[str, list[float]] = {}
        self.seen = 0

    def add(self, event: StepEvent) -> Slow | None:
        """Take a step; a ``Slow`` when this run's shape is now far below its usual rate."""
        self.seen += 1
        if self.seen <= WARMUP_STEPS or event.rows == 0:
            return None
        shape = shape_key(event.rows, event.esamp)
        rates = self.steps.setdefault(shape, [])
        rates.append(event.tokens_per_s)
        usual = self.record.usual(shape)
        if usual is None or len(rates) < MIN_STEPS:
            return None
        now = statistics.median(rates[-3 * MIN_STEPS :])
        return Slow(now, usual) if now < SLOW_FRACTION * usual else None

    def end_run(self) -> None:
        """Add this run's medians to the record (the caller saves it) and start afresh."""
        for shape, rates in self.steps.items():
            if len(rates) >= MIN_STEPS:
                self.record.add(shape, statistics.median(rates))
        self.steps, self.seen = {}, 0
