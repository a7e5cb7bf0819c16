"""Run the arms of an evaluation, the baseline, the plain arms and each cell, over the same
problems and seeds.

An arm is ``baseline`` (ESamp off), a plain arm (ESamp off, its own filters) or a cell
(``esamp.eval.matrix``): one prompt group per problem and arm, n samples each. Every finished group
is graded at once and appended as one JSON line to ``samples.jsonl`` in the task's output folder,
with its texts, verdicts and diversity, and, for a steered group, how its Distiller learned
(``GroupTrace``: the loss of each of its optimizer steps and the mean novelty at each token
position). A later run with the same settings reads that file and skips what is done, so an
interrupted evaluation resumes where it stopped, per group and so per cell, and ends with the same
records as one that never stopped. Cells and plain arms can be added to a finished folder: only the
new ones are sampled, against the baseline already there.

How the problems reach the model (``esamp.eval.prompts``: the chat template, or a completion frame
for a model without one) is known once the engine has loaded; ``record_prompts`` then checks it
against the folder's and records it.
"""

from __future__ import annotations

import copy
import json
import os
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from esamp.core.config import EsampConfig, SamplingConfig, make_config, settings_fields
from esamp.errors import ConfigError, EngineError, EsampError
from esamp.eval.matrix import BASELINE, SINGLE, Cell, PlainArm
from esamp.eval.prompts import CHAT, PromptFrame, describe_record
from esamp.eval.tasks import Problem

RECORDS = "samples.jsonl"
SETTINGS = "run.json"
SESSIONS = "sessions.json"
# Where esamp eval's defaults differ from the sampling model's (SamplingConfig): more samples and
# longer replies, since Pass@k over a handful of short samples says little.
EVAL_DEFAULTS = {"n": 8, "max_tokens": 256}
# Settings that change no sample: a resumed run may change them.
REPORT_ONLY = frozenset({"ks"})
# The run.json keys that hold named arms; a folder gathers them over runs.
ARM_KEYS = ("plain", "cells")
# The run.json key of the prompt frame, which the loaded engine decides (``record_prompts``).
PROMPTS = "prompts"


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    return sorted({2**i for i in range(7) if 2**i <= n} | {n})


class EvalSettings:
    """Everything that decides one task's samples: the problems, the sampling, the cells and
    the plain arms.

    ``sampling`` holds n, max_tokens, the filters and the base seed (each problem's seed derives
    from it). Sampling fields may also be given one by one (``n=4``); for a run with one cell,
    so may its ESamp settings (``beta=0.3``). A resumed run must match exactly, ``ks`` aside.
    """

    def __init__(
        self,
        task: str,
        problem_ids: Sequence[str],
        ks: Sequence[int] | None = None,
        cells: Sequence[Cell] | None = None,
        engine: str = "reference",
        model: str | None = None,
        sampling: SamplingConfig | None = None,
        plain: Sequence[PlainArm] = (),
        **values: Any,
    ) -> None:
        steering = {k: values.pop(k) for k in list(values) if k in settings_fields(EsampConfig)}
        if sampling is None:
            sampling = make_config(SamplingConfig, **{**EVAL_DEFAULTS, **values})
        elif values:
            raise TypeError(f"pass sampling settings in sampling=, not as {sorted(values)}")
        if cells is None:
            cells = [Cell(SINGLE, make_config(EsampConfig, **steering))]
        elif steering:
            raise TypeError(f"pass ESamp settings in cells=, not as {sorted(steering)}")
        plain = list(plain)
        for index, arm in enumerate(plain):
            if arm.sampling(sampling) == sampling:
                raise ConfigError(
                    f"plain arm {arm.name} samples exactly like the baseline of {task}",
                    hint="leave it out: the baseline is already a point of the temperature curve",
                )
            twin = next((a for a in plain[:index] if a.sampling(sampling) == arm.sampling(sampling)), None)
            if twin is not None:
                raise ConfigError(
                    f"plain arm {arm.name} samples exactly like {twin.name}", hint="list every plain setting once"
                )
        names = [c.name for c in cells] + [a.name for a in plain]
        if len(set(names)) != len(names) or BASELINE in names:
            raise ConfigError(
                f"arm names must be unique and not {BASELINE!r}: {names}", hint="list every matrix and plain value once"
            )
        self.task = task
        self.problem_ids = list(problem_ids)
        self.base_sampling = sampling
        self.cells = list(cells)
        self.plain = list(plain)
        self.ks = list(ks) if ks else default_ks(sampling.n)
        self.engine = engine
        self.model = model
        self.prompts: dict | None = None  # the frame's record, once known (``PromptFrame.record``)

    @property
    def n(self) -> int:
        return self.base_sampling.n

    @property
    def seed(self) -> int:
        return self.base_sampling.seed

    @property
    def max_tokens(self) -> int:
        return self.base_sampling.max_tokens

    @property
    def arms(self) -> list[str]:
        """Every arm, in the order they run: the baseline, the plain arms, the cells."""
        return [BASELINE] + [a.name for a in self.plain] + [c.name for c in self.cells]

    @property
    def plain_arms(self) -> list[str]:
        """The arms that sample without ESamp: the baseline and the plain arms."""
        return [BASELINE] + [a.name for a in self.plain]

    def cell(self, name: str) -> Cell:
        return next(c for c in self.cells if c.name == name)

    def to_dict(self) -> dict:
        return {
            "task": self.task,
            "problem_ids": self.problem_ids,
            **self.base_sampling.model_dump(),
            "ks": self.ks,
            "engine": self.engine,
            "model": self.model,
            "plain": {a.name: a.record() for a in self.plain},
            "cells": {c.name: c.record() for c in self.cells},
            **({PROMPTS: self.prompts} if self.prompts is not None else {}),
        }

    def arm_sampling(self, arm: str) -> SamplingConfig:
        """The sampling of ``arm`` before the problem's seed: a plain arm's own filters, else the
        task's."""
        plain = next((a for a in self.plain if a.name == arm), None)
        return plain.sampling(self.base_sampling) if plain else self.base_sampling

    def sampling(self, problem_id: str, arm: str = BASELINE) -> SamplingConfig:
        """The sampling of one problem and arm: the problem's own seed, shared by every arm."""
        return self.arm_sampling(arm).model_copy(update={"seed": problem_seed(self.seed, problem_id)})

    def esamp_config(self, arm: str, engine: EsampConfig | None = None) -> EsampConfig:
        """The ESamp settings a group of ``arm`` starts with: the cell's own, or (the baseline and
        the plain arms) ESamp off on the settings of the engine it runs on."""
        if arm in self.plain_arms:
            return (engine or self.cells[0].config).with_steering(enabled=False)
        return self.cell(arm).config


def problem_seed(seed: int, problem_id: str) -> int:
    """The sampling seed of one problem: the same for every arm, stable under --limit."""
    return (seed * 1_000_003 + zlib.crc32(problem_id.encode())) % (2**31 - 1)


# -- the output folder ---------------------------------------------------------------------


class ResumeMismatch(EsampError):
    """The output folder holds a run with other settings."""


def check_writable(out: Path, flag: str = "--out") -> None:
    """Fail now, before any sampling, when ``out`` cannot hold the run's files."""
    hint = f"pass {flag} a folder you can write to"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag} {out} is a file, not a folder", hint=hint)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {flag} {out}: {exc.strerror or exc}", hint=hint) from None
    probe = out / f".esamp-write-test-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write into {flag} {out}: {exc.strerror or exc}", hint=hint) from None


def _legacy(theirs: dict) -> dict:
    """A settings file from before cells were recorded: its one ESamp arm as the cell ``esamp``
    (then a run took ESamp's defaults for all but beta and mix)."""
    if "cells" in theirs:
        return theirs
    theirs = dict(theirs)
    steering = {k: theirs.pop(k) for k in ("beta", "mix") if k in theirs}
    record = EsampConfig(**steering).flat()
    theirs["cells"] = {SINGLE: {k: v for k, v in record.items() if k != "slots"}}
    return theirs


def _differences(mine: dict, theirs: dict) -> list[str]:
    """Keys both dicts hold with other values (a key one side lacks was added later, with the
    default of its time)."""
    return sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])


def prepare_out_dir(out: Path, settings: EvalSettings, write: bool = True) -> list[str]:
    """Create ``out`` with its settings file, or check that the one there matches.

    The shared settings (problems, sampling, engine, model) must match; a cell or plain arm
    already recorded must have the same settings; new ones are added (``write=False``: only
    check). The prompt frame is checked once the engine has loaded (``record_prompts``).
    Returns the names of the arms new here.
    """
    check_writable(out)
    path = out / SETTINGS
    mine = settings.to_dict()
    new = [name for key in ARM_KEYS for name in mine[key]]
    if path.exists():
        try:
            theirs = _legacy(json.loads(path.read_text(encoding="utf-8"))["settings"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise ResumeMismatch(
                f"{path} is not an esamp eval settings file", hint="choose another --out folder"
            ) from None
        shared = {k: v for k, v in mine.items() if k not in ARM_KEYS and k not in REPORT_ONLY and k != PROMPTS}
        differ = _differences(shared, {k: v for k, v in theirs.items() if k not in ARM_KEYS})
        if differ:
            raise ResumeMismatch(
                f"{out} holds a run with other settings ({', '.join(differ)} differ)",
                hint="rerun with the same settings to resume it, or pass a new --out folder",
            )
        new, merged = [], {}
        for key, what in zip(ARM_KEYS, ("plain arm", "cell")):
            recorded = theirs.get(key, {})
            for name, arm in mine[key].items():
                differ = _differences(arm, recorded[name]) if name in recorded else []
                if differ:
                    was = ", ".join(f"{k} {recorded[name][k]!r} there, {arm[k]!r} now" for k in differ)
                    raise ResumeMismatch(
                        f"{out} holds the {what} {name} with other settings ({was})",
                        hint="rerun with the same settings, or pass a new --out folder",
                    )
            new += [name for name in mine[key] if name not in recorded]
            merged[key] = {**recorded, **mine[key]}
        mine = {**theirs, **mine, **merged}
    if write:
        _write_json(path, {"settings": mine})
    return new


def record_prompts(out: Path, frame: PromptFrame, legacy: PromptFrame) -> None:
    """Record in ``out``'s settings file (which ``prepare_out_dir`` wrote) how this run's engine
    gets the problems, or refuse (``ResumeMismatch``) a folder whose replies answered prompts
    framed otherwise. ``legacy``: the frame of replies sampled before esamp recorded frames."""
    path = out / SETTINGS
    data = json.loads(path.read_text(encoding="utf-8"))
    recorded = data["settings"].get(PROMPTS)
    if recorded is None and read_records(out):
        recorded = legacy.record()
    if recorded is not None and recorded != frame.record():
        raise ResumeMismatch(
            f"{out} was sampled with its prompts framed otherwise (there: {describe_record(recorded)}; "
            f"now: {frame.describe()})",
            hint="pass a new --out folder, or resume it with the model that sampled it",
        )
    if recorded is None:
        data["settings"][PROMPTS] = frame.record()
        _write_json(path, data)


def with_recorded_cells(settings: EvalSettings, out: Path) -> EvalSettings:
    """``settings`` with every cell and plain arm the folder holds: earlier runs' (they share this
    run's baseline and sampling, which ``prepare_out_dir`` checked) in the order they were added,
    then this run's, and the folder's prompt frame. A report of the folder covers them all."""
    path = out / SETTINGS
    if not path.exists():
        return settings
    theirs = _legacy(json.loads(path.read_text(encoding="utf-8"))["settings"])

    def gather(mine: dict, recorded: dict, make) -> list:
        return [mine.get(name) or make(name, record) for name, record in recorded.items()] + [
            arm for name, arm in mine.items() if name not in recorded
        ]

    merged = copy.copy(settings)
    merged.cells = gather(
        {c.name: c for c in settings.cells},
        theirs.get("cells", {}),
        lambda name, record: Cell(name, make_config(EsampConfig, **record)),
    )
    merged.plain = gather({a.name: a for a in settings.plain}, theirs.get("plain", {}), PlainArm)
    merged.prompts = theirs.get(PROMPTS, settings.prompts)
    return merged


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
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
            raise EsampError(
                f"{path} line {number} is not valid JSON",
                hint="remove that line (its group will run again) or use a new --out",
            ) from None
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


def regrade(out: Path, problems: Sequence[Problem], grade: Grade) -> dict[tuple[str, str], dict]:
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
class GroupTrace:
    """How a group's Distiller learned, from the events every engine emits.

    ``loss[s]``: the loss of the group's s-th optimizer step (``StepEvent.losses``), so its index
    is the step within the group: on the reference engine step s's inputs are the tokens at
    position s − 1 of every running sample (step 0: the prompt's last token). ``novelty[p]``: the
    sum and count of the novelty of the samples' tokens at position p (``TokenEvent.novelty``,
    measured on step p + 1). The same loss values make the dashboard's loss chart
    (``StepEvent.loss`` is their mean over the groups of a step)."""

    loss: list[float] = field(default_factory=list)
    novelty_sum: list[float] = field(default_factory=list)
    novelty_count: list[int] = field(default_factory=list)

    def add_token(self, index: int, novelty: float | None) -> None:
        if novelty is None:
            return
        while len(self.novelty_sum) <= index:
            self.novelty_sum.append(0.0)
            self.novelty_count.append(0)
        self.novelty_sum[index] += novelty
        self.novelty_count[index] += 1

    def record(self) -> dict:
        """The record's fields: ``loss`` (per step) and ``novelty`` (per position: the mean over
        the samples with a value there, null where none has one, and how many had one); None
        where the group gave none (ESamp off, or training off for the loss)."""
        novelty = None
        if any(self.novelty_count):
            novelty = {
                "mean": [round(t / c, 4) if c else None for t, c in zip(self.novelty_sum, self.novelty_count)],
                "samples": list(self.novelty_count),
            }
        return {"loss": [round(v, 6) for v in self.loss] or None, "novelty": novelty}


@dataclass
class _Running:
    problem: Problem
    arm: str
    texts: list[str]
    finish: list[str | None]
    tokens: list[int]
    started: float
    trace: GroupTrace = field(default_factory=GroupTrace)


def arm_group_key(problem: Problem, arm: str) -> str:
    """A problem's group for one arm: ``id|arm`` (both may hold ``-``, so not ``group_key``'s form;
    tests read the arm back from it)."""
    return f"{problem.id}|{arm}"


Grade = Callable[[Problem, list[str]], list[dict] | None]
Measure = Callable[[list[str]], dict | None]
Progress = Callable[[dict, int, int], None]


def run_groups(
    problems: Sequence[Problem],
    engine,
    settings: EvalSettings,
    out: Path,
    grade: Grade,
    measure: Measure,
    progress: Progress | None = None,
    parallel: int = 1,
    arms: Sequence[str] | None = None,
    engine_config: EsampConfig | None = None,
    by_problem: bool = False,
    frame: PromptFrame = CHAT,
) -> dict[tuple[str, str], dict]:
    """Generate, grade and record every (problem, arm) group of ``arms`` not yet in ``out``.

    Arms run one after another (all problems of one, then the next), so an interrupted matrix
    leaves whole cells done; ``by_problem``: every arm of a problem before the next problem, so a
    stopped run leaves whole problems done, and its report (which counts the problems every arm
    finished) covers them. Up to ``parallel`` groups run at once (the vLLM engine batches them;
    the reference engine steps them one after another). ``engine_config`` is the engine's own
    ESamp settings, which the baseline's groups run on. ``frame``: how each problem is put to the
    model, the chat template by default (``esamp.eval.prompts``). Returns all records, old and new.
    """
    records = read_records(out)
    arms = list(arms if arms is not None else settings.arms)
    order = [(p, arm) for p in problems for arm in arms] if by_problem else [(p, arm) for arm in arms for p in problems]
    todo = [(p, arm) for p, arm in order if (p.id, arm) not in records]
    total, done = len(problems) * len(arms), len(problems) * len(arms) - len(todo)
    running: dict[str, _Running] = {}
    queue = list(todo)
    try:
        while queue or running:
            while queue and len(running) < max(1, parallel):
                problem, arm = queue.pop(0)
                key = engine.start(
                    frame.prompt(problem.prompt),
                    frame.sampling(settings.sampling(problem.id, arm)),
                    settings.esamp_config(arm, engine_config).steering,
                    group=arm_group_key(problem, arm),
                    chat=frame.chat,
                )
                running[key] = _Running(
                    problem, arm, [""] * settings.n, [None] * settings.n, [0] * settings.n, time.perf_counter()
                )
            for event in engine.step():
                kind = event.type
                if kind == "token" and event.group in running:
                    running[event.group].texts[event.sample] += event.text
                    running[event.group].trace.add_token(event.index, event.novelty)
                elif kind == "step":
                    for key, losses in event.losses.items():
                        if key in running:
                            running[key].trace.loss.extend(losses)
                elif kind == "done" and event.group in running:
                    g = running[event.group]
                    g.finish[event.sample] = event.finish_reason
                    g.tokens[event.sample] = event.tokens
                elif kind == "error":
                    raise EngineError(
                        f"the engine failed: {event.message}", hint=event.hint or "rerun the same command to resume"
                    )
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
                raise EngineError(
                    "the engine stopped before every sample finished", hint="rerun the same command to resume"
                )
    finally:
        for key in list(running):
            engine.abort(key)
    return records


def missing(problems: Sequence[Problem], records: dict, arms: Iterable[str]) -> dict[str, int]:
    """How many groups of each arm are still to sample."""
    return {arm: sum((p.id, arm) not in records for p in problems) for arm in arms}


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
        **g.trace.record(),
    }


# -- sessions --------------------------------------------------------------------------------


class SessionLog:
    """``sessions.json``: one entry per session that sampled, with its command, engine and wall
    time. The entry is written when the session starts and its time updated after every group,
    so a session that is interrupted or killed still counts."""

    def __init__(self, folder: Path, command: str, started: float) -> None:
        self.path = folder / SESSIONS
        self.started = started
        self.entries = read_sessions(folder)
        self.entry = {
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "wall_seconds": 0.0,
            "finished": False,
            "command": command,
            "environment": None,
        }
        self.entries.append(self.entry)
        self.update()

    def update(self, environment: dict | None = None, finished: bool = False) -> None:
        if environment is not None:
            self.entry["environment"] = environment
        self.entry["wall_seconds"] = round(time.perf_counter() - self.started, 1)
        self.entry["finished"] = finished
        _write_json(self.path, self.entries)


def read_sessions(folder: Path) -> list[dict]:
    path = folder / SESSIONS
    if not path.exists():
        return []
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise EsampError(f"{path} is not valid JSON", hint="delete it (only the wall-time record is lost)") from None
    return entries if isinstance(entries, list) else []


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
            _ = self.math  # the property loads the math grader, or says what to install
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
                v = self.math.check(problem.answer, text, problem.prompt)
                out.append({"correct": v.correct, "extracted": v.extracted, "note": v.note})
            return out
        if problem.kind == "code":
            from esamp.eval.grading import extract_code
            from esamp.eval.sandbox import code_program

            out = []
            for text in texts:
                program = code_program(problem.code_prefix, extract_code(text), problem.tests, problem.entry_point)
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
