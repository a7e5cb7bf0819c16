"""The one event stream every engine emits and every client (CLI, TUI, bench, eval) reads.

Events are small pydantic models with a ``type`` tag, so they pickle across the worker process,
serialise to one JSON object per line (``esamp generate --json``), and validate when read back.

Order guarantees, per group: a sample's token events arrive with ``index`` 0, 1, 2, ... with no
gaps, and its ``done`` event comes after its last token. A token's novelty is the Distiller's
error on the step where that token was the input, so a token is emitted one step after it is
sampled; the final token of a sample has ``novelty=None`` (it is never fed back in).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

FinishReason = Literal["stop", "length", "abort", "error"]


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ReadyEvent(_Event):
    """The engine has loaded its model and accepts work."""

    type: Literal["ready"] = "ready"
    engine: str
    model: str
    device: str
    hidden_size: int = 0
    num_layers: int = 0
    context: int = 0
    load_seconds: float = 0.0


class LoadingEvent(_Event):
    """How far the engine's start has come, before its ``ready``: a model being downloaded (bytes
    or files ``done`` of ``total``), converted or loaded."""

    type: Literal["loading"] = "loading"
    stage: Literal["download", "convert", "load"]
    text: str
    done: float = Field(0.0, ge=0.0)
    total: float = Field(0.0, ge=0.0, description="0 when not known")
    unit: str = Field("", description='"B" for bytes, "files" for a count of files, "" for none')

    def fraction(self) -> float | None:
        return min(1.0, self.done / self.total) if self.total else None

    def describe(self) -> str:
        """In a few words: "downloading bytes 1.2 of 15.2 GB (8%)"."""
        fraction = self.fraction()
        if fraction is None:
            return self.text
        if self.unit == "B":
            done, total = self.done / 1e9, self.total / 1e9
            amount = f"{done:.1f} of {total:.1f} GB" if total >= 1 else f"{1e3 * done:.1f} of {1e3 * total:.1f} MB"
        else:
            amount = f"{self.done:.0f} of {self.total:.0f}" + (f" {self.unit}" if self.unit else "")
        return f"{self.text} {amount} ({100 * fraction:.0f}%)"


class TokenEvent(_Event):
    """One generated token of one sample."""

    type: Literal["token"] = "token"
    group: str
    sample: int = Field(ge=0)
    index: int = Field(ge=0, description="position of the token in the sample's completion")
    token_id: int
    text: str
    novelty: float | None = Field(
        None, ge=0.0, le=1.0, description="normalised Distiller error; None when ESamp is off"
    )


class StepEvent(_Event):
    """Engine-wide counters for one decode step."""

    type: Literal["step"] = "step"
    step: int = Field(ge=0)
    time: float = Field(default_factory=time.time)
    rows: int = Field(ge=0, description="sequences decoded in this step")
    tokens_per_s: float = Field(ge=0.0, description="generated tokens per second, recent window")
    loss: float | None = Field(None, description="mean Distiller loss of this step's training rows")
    losses: dict[str, list[float]] = Field(
        default_factory=dict,
        description="each training group's Distiller loss, one value per optimizer step this event covers, "
        "oldest first; ``loss`` is the mean of them all",
    )
    port_hits: int = Field(0, ge=0, description="tapped rows delivered to the Distiller this step")
    candidates: float = Field(0.0, ge=0.0, description="mean candidate-set size of steered rows")
    esamp: bool = Field(description="whether any row was steered by ESamp in this step")


class DoneEvent(_Event):
    """One sample has finished."""

    type: Literal["done"] = "done"
    group: str
    sample: int = Field(ge=0)
    finish_reason: FinishReason
    tokens: int = Field(ge=0)


class ErrorEvent(_Event):
    """Something failed. ``fatal`` means the engine can take no more work."""

    type: Literal["error"] = "error"
    message: str
    hint: str = ""
    group: str | None = None
    fatal: bool = False
    detail: str = Field("", description="traceback tail, for the error panel")


Event = Annotated[
    LoadingEvent | ReadyEvent | TokenEvent | StepEvent | DoneEvent | ErrorEvent, Field(discriminator="type")
]
_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def event_from_json(line: str) -> Event:
    """Parse and validate one JSON line back into its event class."""
    return _ADAPTER.validate_json(line)


def event_from_dict(data: dict) -> Event:
    return _ADAPTER.validate_python(data)
