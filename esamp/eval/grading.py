"""Grading: pull an answer out of free text, then check it.

Math answers are checked symbolically with ``math-verify``. It guards its parser with
``signal.alarm``, which only works in a main thread, so we turn those timeouts off and run the
check in a child process (``esamp.eval.verify_worker``) that we kill when it overruns. The child
is kept for the whole run: importing sympy costs a second or two, a check costs milliseconds.

Code answers are run by ``esamp.eval.sandbox``; this module only picks the code out of a reply.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass

from esamp.errors import EsampError

# -- answer extraction (pure) ----------------------------------------------------------------

_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:|=)\s*:?\s*|####\s*", re.IGNORECASE)
# A minus sign counts only where no word runs into it: "base-10" and "20-dollar" hold 10 and 20.
_NUMBER = re.compile(r"(?:(?<![\w-])-)?(?:\d[\d,]*(?:\.\d+)?(?:/\d+)?|\.\d+)")
_CLAUSE_END = re.compile(r"(?<!\d)\.(?!\d)|\.(?=\s|$)|, |;|\n| which | because | since ")
_WORD_2 = re.compile(r"[A-Za-z]{2,}")
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_UNEVALUATED = re.compile(r"[\d\s.,+\-*/×()]+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # unbalanced: the reply was cut off inside the box


def _clean_number(token: str) -> str:
    token = token.replace(",", "")
    return token[:-1] if token.endswith(".") else token


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return _clean_number(found[-1]) if found else None


def stated_answer(value: str) -> str | None:
    """The answer in the words that follow "the answer is".

    Only the first clause counts ("12, which is 5 + 7" gives 12); of an equation, its right side
    ("3 + 4 = 7 apples" gives 7). A bare expression is kept whole (``x^2 + 1``, ``\\frac{1}{2}``)
    for the symbolic check, except unevaluated arithmetic ("3 + 4"), which states no value; in
    words, the first number wins ("7 apples" gives 7). Clauses end at ", ", so a tuple answer
    needs ``\\boxed{}``.
    """
    clause = _CLAUSE_END.split(value, maxsplit=1)[0]
    if "=" in clause:
        clause = clause.rsplit("=", 1)[1]
    clause = clause.strip().strip("$").strip()
    if _UNEVALUATED.fullmatch(clause) and re.search(r"\d\s*[-+*/×]\s*\d", clause):
        return None  # "the answer is 3 + 4" names a sum, not its value
    if clause and not _WORD_2.search(_LATEX_COMMAND.sub("", clause)):
        return clause
    numbers = _NUMBER.findall(clause) or _NUMBER.findall(value.split("\n", 1)[0])
    return _clean_number(numbers[0]) if numbers else None


# The result of an equation: "= 12", "equals 12", "is equal to 12", and "7 times 8 is 56".
_OPERATOR = r"(?:times|multiplied by|divided by|plus|minus|over|[-+*/x×÷])"
_RESULT = re.compile(
    r"(?:=|\bequals\b|\bis equal to\b|"
    rf"{_NUMBER.pattern}\s*{_OPERATOR}\s*{_NUMBER.pattern}\s+(?:is|makes|gives)"
    r"(?:\s+(?:actually|just|simply|exactly|indeed))?)"
    r"\s*\$?\s*(" + _NUMBER.pattern + ")",
    re.IGNORECASE,
)


def _value(token: str) -> float | str:
    try:
        return float(token)
    except ValueError:
        return token


def final_number(text: str, question: str | None = None) -> str | None:
    """The number a reply ends on, read as a person would.

    Usually the last number. But a reply that states a result and then restates the question
    ("6 * 5 = 30. So there are 30 eggs in 5 boxes.", "9 * 9 = 81. This answers 9 times 9.")
    ends on a number copied from the question: when every number after the last equation's
    result is that result again or a number of ``question``, the result is the answer.
    """
    last = last_number(text)
    if question is None or last is None:
        return last
    results = list(_RESULT.finditer(text))
    if not results:
        return last
    result = results[-1]
    value = _clean_number(result.group(1))
    given = {_value(_clean_number(n)) for n in _NUMBER.findall(question)} | {_value(value)}
    after = [_value(_clean_number(n)) for n in _NUMBER.findall(text[result.end() :])]
    return value if all(n in given for n in after) else last


def extract_answer(text: str, question: str | None = None) -> str | None:
    """The answer a reply gives: the last ``\\boxed{}``; else what the last "answer is" (or
    "####") states; else the number it ends on (``final_number``: the last number, or the last
    equation's result when only numbers from ``question`` follow it); else None."""
    boxed = last_boxed(text)
    if boxed:
        return boxed
    anchors = list(_ANSWER_IS.finditer(text))
    if anchors:
        stated = stated_answer(text[anchors[-1].end() :])
        if stated:
            return stated
    return final_number(text, question)


_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The code in a reply: the longest fenced block (an unclosed last fence counts), else the
    whole reply."""
    blocks = [b for b in _FENCE.findall(text) if b.strip()]
    if not blocks:
        return text
    return max(blocks, key=len)


# -- math check in a child process ----------------------------------------------------------


@dataclass(frozen=True)
class MathVerdict:
    correct: bool
    extracted: str | None
    note: str = ""  # "timeout", "no answer", or a parse error


def math_verify_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("math_verify") is not None


class MathChecker:
    """Checks answers against gold answers with math-verify, in a child process.

    ``check`` returns a ``MathVerdict``. A check that takes longer than ``timeout`` seconds is
    counted wrong (note ``timeout``), and the child is replaced.
    """

    def __init__(self, timeout: float = 10.0, worker: list[str] | None = None) -> None:
        if worker is None and not math_verify_available():
            raise EsampError(
                "math-verify is not installed, so math answers cannot be checked", hint="pip install 'esamp[eval]'"
            )
        self.timeout = timeout
        self.worker = worker or [sys.executable, "-m", "esamp.eval.verify_worker"]
        self._proc: subprocess.Popen | None = None
        self._selector: selectors.DefaultSelector | None = None
        self._buffer = b""

    def _spawn(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._proc = subprocess.Popen(
            self.worker,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._proc.stdout, selectors.EVENT_READ)
        self._buffer = b""

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._selector.close()
        self._proc = None

    def _ask(self, payload: dict, timeout: float) -> dict | None:
        if self._proc is None or self._proc.poll() is not None:
            self._spawn()
        self._proc.stdin.write((json.dumps(payload) + "\n").encode())
        self._proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not self._selector.select(left):
                self._kill()
                return None
            chunk = os.read(self._proc.stdout.fileno(), 65536)
            if not chunk:  # the child died
                self._kill()
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def equivalent(self, gold: str, answer: str) -> tuple[bool, str]:
        """Whether ``answer`` equals ``gold`` symbolically; (verdict, note)."""
        # The first call also pays for the child's imports.
        timeout = self.timeout + (30.0 if self._proc is None else 0.0)
        reply = self._ask({"gold": gold, "answer": answer}, timeout)
        if reply is None:
            return False, "timeout"
        return bool(reply.get("ok")), reply.get("error") or ""

    def check(self, gold: str, reply_text: str, question: str | None = None) -> MathVerdict:
        extracted = extract_answer(reply_text, question)
        if extracted is None:
            return MathVerdict(False, None, "no answer")
        ok, note = self.equivalent(gold, extracted)
        return MathVerdict(ok, extracted, note)

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=2)
            except Exception:
                pass
            self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
