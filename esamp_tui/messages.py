"""What the dashboard's thread workers send back: one message per result, one handler each.

The engine's own messages come from ``esamp_tui.controller.SessionController``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textual.message import Message

from esamp.platform.gpu import MemorySample


@dataclass
class MemorySampled(Message):
    """A memory reading (None when the sampler failed; it is tried again later)."""

    sample: MemorySample | None


@dataclass
class VendiScored(Message):
    """A finished group's Vendi score, or why there is none."""

    key: str
    score: float | None
    error: str = ""


@dataclass
class Exported(Message):
    """Export finished: the files written, and a note when the PNG could not be made."""

    paths: list[Path]
    note: str = ""


@dataclass
class ExportFailed(Message):
    error: str
