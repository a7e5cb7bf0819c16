"""vLLM's output during ``esamp bench``: into a log file beside the JSON, off the terminal.

While engines start, run and stop, vLLM writes warnings (some with the traceback of an error it
caught and carried on from, such as "Chat template warmup failed ... Tokenizer not available
when `skip_tokenizer_init=True`" for a dummy model), torch's and its C++ warnings and progress
bars. It writes them from this process and from its engine-core and worker processes, which
write to the stderr they inherited. None of it is the bench's result, and on a terminal it buries
the progress lines. vLLM's logging settings (``VLLM_LOGGING_CONFIG_PATH``) would move its own
log records only, not what C++ or tqdm write, nor what the child processes print outside
logging. So the bench points stderr itself, file descriptor 2, at the log while the engines
live: every process started meanwhile inherits it. The bench's own lines go to stdout, as
before (esamp's commands already send vLLM's log to stderr: ``esamp.commands.cli.quiet_vllm_log``).

When something fails, the error still reaches the terminal: the bench raises after stderr is
back, naming the log and quoting the errors it ends with (``failure_hint``).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# "(EngineCore pid=42) " and the like: vLLM's mark on what its child processes write
_PROCESS = re.compile(r"^\(\w+ pid=\d+\)\s*")
# A line of a log record as vLLM formats it ("ERROR 11-27 00:39:22 [core.py:123] message"); a
# record of several lines (a traceback) repeats the head on each
_RECORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+ \S+ \[[^\]]*\] ?(.*)$")
# A traceback's own lines, which name no error: its first line, frames and their source lines
# (an ERROR record with no message at all, which vLLM's workers write as a separator, says nothing either)
_FRAME = re.compile(r"^(\s|Traceback \(most recent call last\)|\^+$)")
# torch's C++ and logging records in glog form ("E1127 00:33:42.339 ...", "[E1127 ...]")
_GLOG_ERROR = re.compile(r"^\[?E\d{4} ")
# The last line of a Python traceback: "ValueError: ...", "torch.OutOfMemoryError: ..."
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(: |$)")
ERROR_LINES = 5  # the most error lines a failure quotes from the log


def log_path(json_path: Path) -> Path:
    """Where the bench writes vLLM's log: beside its JSON, ``out.json`` → ``out.vllm.log`` (a
    name of its own, so a transcript of the terminal kept as ``out.log`` does not clobber it)."""
    return json_path.with_name(json_path.stem + ".vllm.log")


@contextmanager
def stderr_to(path: Path) -> Iterator[Path]:
    """Point this process's stderr (file descriptor 2, and so that of every process started
    inside the block) at ``path``, emptied first, until the block ends; then point it back,
    also when the block raises. Python's ``sys.stderr`` is flushed at both ends, so what was
    written before the block stays on the terminal and what was written inside goes to the log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "wb") as log:
            os.dup2(log.fileno(), 2)  # fd 2 keeps the file open after ``log`` closes
        yield path
    finally:
        try:
            sys.stderr.flush()
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def error_lines(path: Path, limit: int = ERROR_LINES) -> list[str]:
    """The last ``limit`` lines of the log at ``path`` that report an error, from any of the
    processes that wrote it: ERROR and CRITICAL records, torch's error records and the last line
    of each Python traceback, never a traceback's frames nor an empty record. What vLLM logs as a warning is left out,
    even with the traceback of an error it caught and carried on from. Nothing when the log
    cannot be read."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    found = []
    for raw in text.splitlines():
        line = _PROCESS.sub("", raw.rstrip())
        record = _RECORD.match(line)
        if record:
            message = record.group(2)
            error = record.group(1) in ("ERROR", "CRITICAL") and bool(message.strip()) and not _FRAME.match(message)
        else:
            error = bool(_GLOG_ERROR.match(line) or _EXCEPTION.match(line))
        if error:
            found.append(raw.strip())
    return found[-limit:] if limit > 0 else []


def failure_hint(path: Path, advice: str) -> str:
    """A failed bench's hint: ``advice``, where vLLM's log is, and the errors it ends with."""
    lines = error_lines(path)
    text = f"{advice}; vLLM's log is {path}"
    if lines:
        text += ", and its last errors are:\n    " + "\n    ".join(lines)
    return text
