"""Child process for ``MathChecker``: one JSON request per line in, one verdict per line out.

math-verify's own signal-based timeouts are turned off here; the parent enforces a timeout by
killing this process.
"""

from __future__ import annotations

import json
import logging
import sys


def _as_latex(text: str) -> str:
    text = text.strip()
    if text.startswith("$") or text.startswith("\\(") or text.startswith("\\["):
        return text
    return f"${text}$"


def main() -> None:
    logging.disable(logging.WARNING)  # math-verify warns on every call that timeouts are off
    from math_verify import parse, verify

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            gold = parse(_as_latex(req["gold"]), parsing_timeout=None)
            answer = parse(_as_latex(req["answer"]), parsing_timeout=None)
            ok = bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=None)
            out = {"ok": bool(ok), "error": None}
        except Exception as exc:  # a malformed expression is a wrong answer, not a crash
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
