"""A script that starts an engine at its top level, without ``if __name__ == "__main__":``, is told
so before anything is spawned (on a GPU vLLM starts its processes with spawn, which imports the
script again in each one; the dashboard's worker always starts so)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from esamp.platform.spawn import unguarded_line

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "source, line, unguarded",
    [
        ("import x\nengine = build()\n", 2, True),
        ("def main():\n    build()\n\nmain()\n", 4, True),
        ('if __name__ == "__main__":\n    build()\n', 2, False),
        ("if '__main__' == __name__:\n    main()\n", 2, False),
        ('if __name__ == "__main__" and fast:\n    main()\n', 2, True),  # not the guard itself
        ("if DEBUG:\n    main()\n", 2, True),
    ],
)
def test_the_guard_is_recognised(source, line, unguarded):
    assert unguarded_line(source, line) is unguarded


def run_script(tmp_path, body: str, **env) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        cwd=tmp_path,
    )


@pytest.mark.vllm
def test_a_vllm_engine_at_a_scripts_top_level_is_refused_with_what_to_do(tmp_path):
    """vLLM told to spawn (as on a GPU): refused before vLLM loads anything, in words that name
    the fix; the same script with the guard gets past the check (to the model it cannot find)."""
    body = """
        from esamp.engines import create_engine
        from esamp.errors import EsampError
        try:
            create_engine("vllm", model="/no/such/model")
        except EsampError as exc:
            print("ERROR", exc.user_text())
        """
    spawning = dict(VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    out = run_script(tmp_path, body, **spawning)
    assert "ERROR" in out.stdout and 'outside `if __name__ == "__main__":`' in out.stdout, out.stdout + out.stderr
    assert "docs/library.md" in out.stdout and "bootstrapping" not in out.stdout + out.stderr

    guarded = (
        "def main():\n" + textwrap.indent(textwrap.dedent(body), "    ") + '\nif __name__ == "__main__":\n    main()\n'
    )
    out = run_script(tmp_path, guarded, **spawning)
    assert "ERROR" in out.stdout and "__main__" not in out.stdout and "not found" in out.stdout, out.stdout


def test_a_dashboard_session_at_a_scripts_top_level_is_refused(tmp_path):
    """The dashboard's worker is always spawned: ``Session.start`` asks first."""
    out = run_script(
        tmp_path,
        """
        from esamp.errors import EsampError
        from esamp_tui.worker import Session, SessionSpec
        try:
            Session(SessionSpec(engine_factory="no.such:factory")).start()
        except EsampError as exc:
            print("ERROR", exc.message)
        """,
    )
    assert "ERROR" in out.stdout and "starts the dashboard's engine process at its top level" in out.stdout, out.stderr


def test_a_packages_main_is_not_run_again_by_spawn_so_it_passes(tmp_path):
    """``python -m package`` runs ``package/__main__.py``, which spawn never imports again (as
    ``python -m esamp generate`` does): no error, whatever its top level does."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(
        "from esamp.platform.spawn import check_main_guard\ncheck_main_guard('x')\nprint('PASSED')\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "pkg"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}"},
    )
    assert "PASSED" in out.stdout, out.stderr
