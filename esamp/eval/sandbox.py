"""Run untrusted Python (a model's code plus a task's tests) in a bubblewrap sandbox.

What the sandbox enforces:

- no network: a fresh network namespace with only its own loopback;
- a read-only view of the filesystem, except a private, empty tmpfs at /tmp (the working dir);
- its own PID namespace, so everything it started dies when it ends;
- CPU-time, address-space and process-count limits (``prlimit``), and a wall-clock timeout
  after which the whole process group is killed;
- when we are root, the code runs as ``nobody`` (the process limit does not bind root).

The program is fed on standard input, so no host file is shared with the sandbox. Without
``bwrap`` the sandbox refuses to run anything: running model-written code bare is not an option.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

from esamp.errors import EsampError

NOBODY = 65534


class SandboxUnavailable(EsampError):
    """No usable sandbox on this machine."""


@dataclass(frozen=True)
class Limits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30
    processes: int = 32


@dataclass(frozen=True)
class SandboxResult:
    passed: bool  # exited with status 0 in time
    returncode: int | None
    timed_out: bool
    output: str  # the tail of stdout + stderr

    @property
    def status(self) -> str:
        if self.timed_out:
            return "timeout"
        return "passed" if self.passed else f"failed (exit {self.returncode})"


def _python_candidates() -> list[str]:
    """Interpreters to try inside the sandbox: ours first, then the system's. Ours may live where
    the sandbox user cannot reach it (e.g. under /root); the tests need only the standard library."""
    found = [os.path.realpath(sys.executable)]
    for name in ("python3", f"python{sys.version_info.major}.{sys.version_info.minor}"):
        for folder in ("/usr/bin", "/usr/local/bin", "/bin"):
            path = os.path.join(folder, name)
            if os.access(path, os.X_OK) and os.path.realpath(path) not in found:
                found.append(os.path.realpath(path))
    return found


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


class Sandbox:
    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.bwrap = shutil.which("bwrap")
        self.prlimit = shutil.which("prlimit")
        if not self.bwrap or not self.prlimit:
            missing = "bwrap (bubblewrap)" if not self.bwrap else "prlimit (util-linux)"
            raise SandboxUnavailable(
                f"no sandbox for running generated code: {missing} was not found",
                hint="install it (Debian/Ubuntu: apt-get install bubblewrap); esamp will not "
                "run model-written code outside a sandbox",
            )
        self.python: str | None = None  # chosen by the self-test

    def command(self) -> tuple[list[str], int | None]:
        """The argv that runs a program read from stdin, and the uid to run it as (or None)."""
        as_root = os.geteuid() == 0
        uid = NOBODY if as_root else None
        # RLIMIT_NPROC counts every process of the user, so leave room for the ones it has.
        nproc = self.limits.processes + (0 if as_root else _processes_of(os.geteuid()))
        argv = [
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--ro-bind",
            "/",
            "/",
            "--tmpfs",
            "/tmp",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--chdir",
            "/tmp",
            "--setenv",
            "HOME",
            "/tmp",
            self.prlimit,
            f"--as={self.limits.memory_bytes}",
            f"--cpu={self.limits.cpu_seconds}",
            f"--nproc={nproc}",
            "--core=0",
            self.python or _python_candidates()[0],
            "-I",
            "-",
        ]
        return argv, uid

    def run(self, program: str) -> SandboxResult:
        if self.python is None:
            self._self_test()
        return self._run(program)

    def _run(self, program: str) -> SandboxResult:
        argv, uid = self.command()
        extra = dict(user=uid, group=uid, extra_groups=[]) if uid is not None else {}
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            **extra,
        )
        try:
            out, _ = proc.communicate(program.encode(), timeout=self.limits.wall_seconds)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            timed_out = True
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        text = out.decode(errors="replace")[-2000:]
        rc = proc.returncode
        return SandboxResult(passed=(rc == 0 and not timed_out), returncode=rc, timed_out=timed_out, output=text)

    def _self_test(self) -> None:
        """Pick an interpreter that runs inside the sandbox; fail loudly, once, when none does
        (e.g. bwrap is present but user namespaces are disabled)."""
        last = "no output"
        for candidate in _python_candidates():
            self.python = candidate
            result = self._run("print('sandbox-ok')")
            if "sandbox-ok" in result.output:
                return
            last = (result.output.strip().splitlines() or ["no output"])[-1]
        self.python = None
        raise SandboxUnavailable(
            f"bubblewrap is installed but could not run Python in a sandbox: {last}",
            hint="allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1) "
            "and make a python3 readable by all users (e.g. /usr/bin/python3); esamp will not "
            "run model-written code outside a sandbox",
        )


def code_program(prefix: str, code: str, tests: str, entry_point: str | None) -> str:
    """The script that checks one completion.

    ``prefix`` is the task's given code (HumanEval: the signature and docstring). A completion
    whose first line is indented continues it (a function body); otherwise it is placed after
    it, so that a complete function in the reply replaces the stub.
    """
    first = next((line for line in code.splitlines() if line.strip()), "")
    if prefix and first[:1] in (" ", "\t"):
        body = prefix + code
    elif prefix:
        body = prefix + "\n    pass\n\n" + code if prefix.rstrip().endswith(":") else prefix + "\n" + code
    else:
        body = code
    program = body + "\n\n" + tests + "\n"
    if entry_point:
        program += f"\ncheck({entry_point})\n"
    return program
