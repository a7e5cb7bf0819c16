"""CPU threads of the reference engine: how many, and how OpenMP's idle threads wait.

Measured with ``benchmarks/threads.py`` on a 2-core CPU (``benchmarks/results/threads-cpu.json``;
docs/models.md, "Threads on a CPU"): on an idle machine a second thread gains little on the embedded model, whose
decode step is many short operations the threads must meet at the end of; when another process
holds a core, two threads under OpenMP's default wait policy collapse (a thread that finished
its share spins, waiting for a sibling that lost its core), while one thread keeps its speed.

Hence one thread by default, and ``--threads N`` for a machine known to be idle or a larger model.
OpenMP's passive wait policy (threads sleep at once instead of spinning) keeps N > 1 from
collapsing under load, at a cost when idle, and changes nothing for one thread; esamp's commands
ask for it unless ``OMP_WAIT_POLICY`` is already set. libgomp reads the variable once, when torch
loads it: set after ``import torch`` it does nothing, so the commands set it first thing, and
worker processes started with ``spawn`` inherit it.
"""

from __future__ import annotations

import argparse
import os

from esamp.errors import ConfigError

DEFAULT_THREADS = 1
WAIT_POLICY_VARIABLE = "OMP_WAIT_POLICY"
WAIT_POLICY = "PASSIVE"


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def prefer_passive_wait() -> None:
    """Ask OpenMP to let idle threads sleep, unless the user chose a policy.

    Effective only in a process that has not loaded torch yet, and in the processes it starts.
    """
    os.environ.setdefault(WAIT_POLICY_VARIABLE, WAIT_POLICY)


def _problem(threads: object) -> str | None:
    """Why ``threads`` is not a usable thread count, or None when it is."""
    cores = available_cores()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        return f"{threads!r} is not a thread count: use 1 to {cores}"
    if threads > cores:
        return (
            f"{threads} is more than the {cores} CPU core{'s' if cores != 1 else ''} this process "
            f"may use; more threads than cores only wait for each other (use 1 to {cores})"
        )
    return None


def check_threads(threads: int | None) -> int:
    """The thread count to use: ``threads``, or the default when None; ``ConfigError`` if unusable."""
    if threads is None:
        return DEFAULT_THREADS
    problem = _problem(threads)
    if problem:
        raise ConfigError(f"--threads={threads}: {problem}", hint=_HINT)
    return threads


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count for the reference engine; returns the count used."""
    count = check_threads(threads)
    import torch

    torch.set_num_threads(count)
    return count


_HINT = "leave --threads out (1 thread) on a shared machine; more only on idle cores"


def _thread_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = text
    problem = _problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def add_threads_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--threads N``, the same on every command that can run the reference engine."""
    parser.add_argument(
        "--threads",
        type=_thread_count,
        default=None,
        metavar="N",
        help=f"CPU threads of the reference engine (default {DEFAULT_THREADS}: more threads gain "
        "little on small models and collapse when other jobs share the cores)",
    )


def threads_option(engine: str, threads: int | None) -> dict:
    """``create_engine`` keyword arguments for ``--threads``: only the reference engine takes them."""
    if threads is None:
        return {}
    if engine == "auto":
        from esamp.platform.devices import vllm_usable

        engine = "vllm" if vllm_usable() else "reference"
    return {"threads": threads} if engine == "reference" else {}
