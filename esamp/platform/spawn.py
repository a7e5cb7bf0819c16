"""Whether this program can start processes with ``spawn``, asked before it starts one.

``spawn`` (what vLLM uses on a GPU, and what the dashboard uses for its engine) runs the main
script again in every new process, as a module named ``__mp_main__``. A script that builds an
engine at its top level, outside ``if __name__ == "__main__":``, would then build another engine in
each new process; Python stops that with a ``RuntimeError`` about a "bootstrapping phase" and
``freeze_support()`` that sends the reader the wrong way. ``check_main_guard`` finds the problem
first and says what to do.
"""

from __future__ import annotations

import ast
import multiprocessing
import sys
import threading
from pathlib import Path

from esamp.errors import EngineError

GUARD = 'if __name__ == "__main__":'


def _is_guard(node: ast.stmt) -> bool:
    """``node`` is ``if __name__ == "__main__":`` (either way round)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    test = node.test
    if len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    values = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and values == ["__main__"]


def _main_frame():
    """The frame running the main script's top level, when the main thread is inside it (asked
    from any thread: the dashboard starts its worker from a thread of its own), and spawn would
    run that top level again (it does not for a package's ``__main__``: ``python -m esamp``)."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if name == "__main__" or name.endswith(".__main__"):
        return None
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is getattr(main, "__dict__", None):
            return frame
        frame = frame.f_back
    return None


def unguarded_line(source: str, line: int) -> bool:
    """Whether line ``line`` of the module ``source`` runs at import (no ``__main__`` guard
    around the top-level statement that holds it)."""
    for node in ast.parse(source).body:
        end = getattr(node, "end_lineno", node.lineno)
        if node.lineno <= line <= end:
            return not _is_guard(node)
    return True


def check_main_guard(what: str) -> None:
    """Raise ``EngineError`` when starting a ``spawn`` process now would run the main script's
    top level again: the caller is that top level, not under ``if __name__ == "__main__":``, or
    this process is itself being started by ``spawn`` and is re-running it. ``what`` names what
    would be started."""
    hint = (
        f"put the code that builds it under `{GUARD}` (or in a function called from there): "
        "spawn imports the script again in every new process, which would build it again "
        "(docs/library.md shows the pattern)"
    )
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise EngineError(f"{what} was started while a spawned process was importing the main script", hint=hint)
    frame = _main_frame()
    if frame is None:
        return  # interactive, python -c, a notebook, or code run after the script's top level
    path = frame.f_code.co_filename
    try:
        source = Path(path).read_text(encoding="utf-8")
        unguarded = unguarded_line(source, frame.f_lineno)
    except (OSError, SyntaxError, ValueError):
        return  # cannot read the script: let multiprocessing judge
    if unguarded:
        raise EngineError(f"{path} starts {what} at its top level, outside `{GUARD}`", hint=hint)
