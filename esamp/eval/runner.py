"""Run both arms, baseline and ESamp, over the same problems with the same seeds.

Every finished prompt group (one problem, one arm, n samples) is graded at once and appended as
one JSON line to ``samples.jsonl`` in the output folder, with its texts, verdicts and diversity.
A later run with the same settings reads that file and skips what is done, so an interrupted
evaluation resumes where it stopped and ends with the same records as one that never stopped.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from esamp.core.config import EsampConfig, SamplingConfig, make_config
from esamp.errors import EngineError, EsampError
from esamp.eval.tasks import Problem

ARMS = ("baseline", "esamp")
RECORDS = "samples.jsonl"
SETTINGS = "run.json"


@dataclass
class EvalSettings:
    """Everything that decides the samples; a resumed run must match it exactly."""

    task: str
    problem_ids: list[str]
    n: int = 8
    ks: list[int] = field(default_factory=lambda: [1, 4, 8])
    beta: float = 0.8
    mix: str = "paper"
    seed: int = 0
    max_tokens: int = 256
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 0
    min_p: float = 0.1
    engine: str = "reference"
    model: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def sampling(self, problem_id: str) -> SamplingConfig:
        return make_config(SamplingConfig, n=self.n, temperature=self.temperature, top_p=self.top_p,
                           top_k=self.top_k, min_p=self.min_p, max_tokens=self.max_tokens,
                           seed=problem_seed(self.seed, problem_id))

    def esamp_config(self, arm: str) -> EsampConfig:
        if arm == "baseline":
            return EsampConfig(enabled=False)
        return make_config(EsampConfig, enabled=True, beta=self.beta, mix=self.mix)


def problem_seed(seed: int, problem_id: str) -> int:
    """The sampling seed of one problem: the same for both arms, stable under --limit."""
    return (seed * 1_000_003 + zlib.crc32(problem_id.encode())) % (2**31 - 1)


# -- the output folder ---------------------------------------------------------------------


class ResumeMismatch(EsampError):
    """The output folder holds a run with other settings."""


def prepare_out_dir(out: Path, settings: EvalSettings) -> None:
    """Create ``out`` with its settings file, or check that an existing one matches."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / SETTINGS
    mine = settings.to_dict()
    if path.exists():
        try:
            theirs = json.loads(path.read_text())["settings"]
        except (ValueError, KeyError):
            raise ResumeMismatch(f"{path} is not an esamp eval settings file",
                                 hint="choose another --out folder") from None
        differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if differ:
            raise ResumeMismatch(
                f"{out} holds a run with other settings ({', '.join(differ)} differ)",
                hint="rerun with the same settings to resume it, or pass a new --out folder",
            )
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"settings": mine}, indent=2) + "\n")
    os.replace(tmp, path)


def read_records(out: Path) -> dict[tuple[str, str], dict]:
    """Finished groups keyed by (problem id, arm). A cut-off last line (the run was killed while
    writing it) is dropped; any other broken line is an error."""
    path = out / RECORDS
    records: dict[tuple[str, str], dict] = {}
    if not path.exists():
        return records
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not line.endswith("\n"):
                break  # the write was interrupted; this group runs again
            raise EsampError(f"{path} line {number} is not valid JSON",
                             hint="remove that line (its group will run again) or use a new --out") from None
        records[(rec["problem"], rec["arm"])] = rec
    return records


def append_record(out: Path, record: dict) -> None:
    path = out / RECORDS
    # A cut-off line left by a killed run would glue onto this one: end it first.
    if path.exists() and path.stat().st_size:
        with path.open("rb") as fh:
            fh.seek(-1, os.SEEK_END)
            needs_newline = fh.read(1) != b"\n"
        if needs_newline:
            with path.open("rb+") as fh:
                text = fh.read()
                fh.seek(text.rfind(b"\n") + 1)
                fh.truncate()
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def regrade(out: Path, problems: Sequence[Problem], grade: "Grade") -> dict[tuple[str, str], dict]:
    """Grade the stored replies again with the current graders and rewrite the records file
    (atomically), e.g. after the answer extraction improved. Nothing is generated."""
    records = read_records(out)
    by_id = {p.id: p for p in problems}
    for rec in records.values():
        problem = by_id.get(rec["problem"])
        if problem is None:
            continue
        verdicts = grade(problem, rec["texts"])
        rec["verdicts"] = verdicts
        rec["correct"] = None if verdicts is None else sum(bool(v["correct"]) for v in verdicts)
    tmp = out / (RECORDS + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for rec in records.values():
            fh.write(json.dumps(rec) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out / RECORDS)
    return records


# -- generation ----------------------------------------------------------------------------


@dataclass
class _Running:
    problem: Problem
    arm: str
    texts: list[str]
    finish: list[str | None]
    tokens: list[int]
    started: float


def group_key(problem: Problem, arm: str) -> str:
    return f"{problem.id}|{arm}"


Grade = Callable[[Problem, list[str]], list[dict] | None]
Measure = Callable[[list[str]], dict | None]
Progress = Callable[[dict, int, int], None]


def run_groups(problems: Sequence[Problem], engine, settings: EvalSettings, out: Path,
               grade: Grade, measure: Measure, progress: Progress | None = None,
               parallel: int = 1) -> dict[tuple[str, str], dict]:
    """Generate, grade and record every (problem, arm) group not yet in ``out``.

    Up to ``parallel`` groups run at once (the vLLM engine batches them; the reference engine
    steps them one after another). Returns all records, old and new.
    """
    records = read_records(out)
    todo = [(p, arm) for p in problems for arm in ARMS if (p.id, arm) not in records]
    total, done = len(problems) * len(ARMS), len(problems) * len(ARMS) - len(todo)
    running: dict[str, _Running] = {}
    queue = list(todo)
    try:
        while queue or running:
            while queue and len(running) < max(1, parallel):
                problem, arm = queue.pop(0)
                key = engine.start(problem.prompt, settings.sampling(problem.id),
                                   settings.esamp_config(arm), group=group_key(problem, arm))
                running[key] = _Running(problem, arm, [""] * settings.n, [None] * settings.n,
                                        [0] * settings.n, time.perf_counter())
            for event in engine.step():
                kind = event.type
                if kind == "token" and event.group in running:
                    running[event.group].texts[event.sample] += event.text
                elif kind == "done" and event.group in running:
                    g = running[event.group]
                    g.finish[event.sample] = event.finish_reason
                    g.tokens[event.sample] = event.tokens
                elif kind == "error":
                    raise EngineError(f"the engine failed: {event.message}",
                                      hint=event.hint or "rerun the same command to resume")
            for key in [k for k, g in running.items() if all(f is not None for f in g.finish)]:
                g = running.pop(key)
                record = _record(g, settings, grade, measure)
                append_record(out, record)
                records[(g.problem.id, g.arm)] = record
                done += 1
                if progress:
                    progress(record, done, total)
            if not running and not queue:
                break
            if running and not engine.has_unfinished():
                raise EngineError("the engine stopped before every sample finished",
                                  hint="rerun the same command to resume")
    finally:
        for key in list(running):
            engine.abort(key)
    return records


def _record(g: _Running, settings: EvalSettings, grade: Grade, measure: Measure) -> dict:
    seconds = time.perf_counter() - g.started
    verdicts = grade(g.problem, g.texts)
    return {
        "problem": g.problem.id,
        "arm": g.arm,
        "kind": g.problem.kind,
        "seed": problem_seed(settings.seed, g.problem.id),
        "texts": g.texts,
        "finish": g.finish,
        "tokens": g.tokens,
        "seconds": round(seconds, 3),
        "verdicts": verdicts,
        "correct": None if verdicts is None else sum(bool(v["correct"]) for v in verdicts),
        "diversity": measure(g.texts),
    }


# -- graders as one callable -----------------------------------------------------------------


class Graders:
    """Grades a group's replies by the problem's kind; builds the checker or sandbox on first use."""

    def __init__(self, math_timeout: float = 10.0, sandbox_limits=None) -> None:
        self.math_timeout = math_timeout
        self.sandbox_limits = sandbox_limits
        self._math = None
        self._sandbox = None

    def prepare(self, kinds: Iterable[str]) -> None:
        """Fail before generating anything when a needed grader is missing."""
        kinds = set(kinds)
        if "math" in kinds:
            self.math
        if "code" in kinds:
            self.sandbox.run("pass")

    @property
    def math(self):
        if self._math is None:
            from esamp.eval.grading import MathChecker

            self._math = MathChecker(self.math_timeout)
        return self._math

    @property
    def sandbox(self):
        if self._sandbox is None:
            from esamp.eval.sandbox import Sandbox

            self._sandbox = Sandbox(self.sandbox_limits)
        return self._sandbox

    def __call__(self, problem: Problem, texts: list[str]) -> list[dict] | None:
        if problem.kind == "math":
            out = []
            for text in texts:
                v = self.math.check(problem.answer, text)
                out.append({"correct": v.correct, "extracted": v.extracted, "note": v.note})
            return out
        if problem.kind == "code":
            from esamp.eval.grading import extract_code
            from esamp.eval.sandbox import code_program

            out = []
            for text in texts:
                program = code_program(problem.code_prefix, extract_code(text), problem.tests,
                                       problem.entry_point)
                result = self.sandbox.run(program)
                out.append({"correct": result.passed, "extracted": None, "note": result.status})
            return out
        return None

    def close(self) -> None:
        if self._math is not None:
            self._math.close()
            self._math = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
