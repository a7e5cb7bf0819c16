"""What ``esamp bench`` runs: workload shapes, presets, token-id prompts, rounds per trial."""

from __future__ import annotations

import math
import random
import re
import statistics

from esamp.core.config import Filters, Steering
from esamp.errors import ConfigError

# Filter and steering settings per preset; "default" is the settings models' own defaults.
PRESETS: dict[str, dict] = {
    "default": dict(
        workloads=("16x64", "32xn8x256"),
        sampling=Filters().model_dump(),
        steering=Steering().model_dump(include={"beta"}),
    ),
    "fair": dict(
        workloads=("8xn16x256",), sampling=Filters(top_p=1.0, min_p=0.05).model_dump(), steering=dict(beta=0.1)
    ),
}
# Without a GPU (vLLM on the CPU): the embedded model and workloads that finish in a few minutes.
CPU_WORKLOADS = ("4x32", "2xn4x32")
CPU_TRIALS = 2
# A timed trial repeats its workload until it lasts about this long (the same number of rounds on
# every side, interleaved round by round with the other sides).
MIN_TRIAL_SECONDS = 1.0
MAX_ROUNDS = 100
# A workload's ratios are trusted when every trial's ratio lies within this share of their median;
# past it, the trials are run again with passes twice as long, at most MAX_LENGTHENINGS times.
SPREAD_TARGET = 0.03
MAX_LENGTHENINGS = 2


def parse_workload(spec: str) -> tuple[int, int, int]:
    """``16x64`` → (16, 1, 64); ``32xn8x256`` → (32, 8, 256)."""
    m = re.fullmatch(r"(\d+)x(?:n(\d+)x)?(\d+)", spec.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(3)) < 1 or (m.group(2) and int(m.group(2)) < 1):
        raise ConfigError(
            f"bad workload {spec!r}",
            hint="write PROMPTSxTOKENS (16x64), PROMPTSxnSAMPLESxTOKENS (32xn8x256) or a "
            "preset name (" + ", ".join(p for p in PRESETS if p != "default") + ")",
        )
    return int(m.group(1)), int(m.group(2) or 1), int(m.group(3))


def parse_workloads(text: str) -> list[tuple[str, tuple[int, int, int]]]:
    """``16x64,fair`` → [("default", (16, 1, 64)), ("fair", (8, 16, 256))]."""
    out = []
    for spec in (s.strip() for s in text.split(",") if s.strip()):
        if spec in PRESETS and spec != "default":
            out += [(spec, parse_workload(w)) for w in PRESETS[spec]["workloads"]]
        else:
            out.append(("default", parse_workload(spec)))
    if not out:
        raise ConfigError("no workload given", hint="e.g. --workloads 16x64,32xn8x256,fair")
    return out


def workload_name(preset: str, shape: tuple[int, int, int]) -> str:
    P, n, L = shape
    name = f"{P}x{L}" if n == 1 else f"{P}xn{n}x{L}"
    return name if preset == "default" else f"{name} ({preset})"


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` random token-id prompts of ``length`` tokens (ids away from the special ones)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def spread(ratios: list[float]) -> float:
    """How far the farthest ratio lies from the median, as a share of the median."""
    mid = statistics.median(ratios)
    return max(abs(r - mid) for r in ratios) / mid if mid else math.inf


def rounds_for(one_pass_seconds: float, min_seconds: float) -> int:
    """How many back-to-back passes of a workload make a trial of at least ``min_seconds``."""
    if min_seconds <= 0 or one_pass_seconds >= min_seconds:
        return 1
    return min(MAX_ROUNDS, math.ceil(min_seconds / max(one_pass_seconds, 1e-6)))
