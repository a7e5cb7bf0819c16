"""Typed settings for ESamp and for sampling, with errors that name the field and its range.

Defaults are the settings of the published Pass@k matrix (DESIGN §3): T 0.8, top-p 0.95,
min-p 0.1, beta 0.8.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from esamp.errors import ConfigError

Mix = Literal["paper", "unsharpened"]
Optimizer = Literal["adam", "sgd"]


class EsampConfig(BaseModel):
    """How the Distiller is built and trained, and how it steers the sampler."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    enabled: bool = Field(True, description="steer the sampler (off = plain sampling, no Distiller)")
    beta: float = Field(0.8, ge=0.0, le=10.0, description="strength of the novelty reward")
    mix: Mix = Field(
        "paper",
        description="'paper': (1+beta)*z/T - beta*d; 'unsharpened': z/T - beta*d (no extra sharpening)",
    )
    rank: int = Field(64, ge=1, le=1024, description="rank of the Distiller's low-rank residual")
    lr: float = Field(1e-3, gt=0.0, le=1.0, description="Distiller learning rate")
    optimizer: Optimizer = Field("adam", description="Distiller optimizer")
    train: bool = Field(True, description="take one Distiller training step per decode step")
    source_layer: int = Field(0, description="decoder layer whose input norm is the source tap")
    target_layer: int = Field(-1, description="decoder layer whose input norm is the target tap (-1 = last)")
    slots: int = Field(64, ge=1, le=4096, description="Distiller slots (prompt groups running at once)")
    seed: int = Field(0, ge=0, description="seed for the Distiller's initial weights")


class SamplingConfig(BaseModel):
    """The request's own sampling settings; ESamp keeps them and steers within their candidates."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    n: int = Field(4, ge=1, le=64, description="samples per prompt")
    temperature: float = Field(0.8, ge=0.0, le=5.0, description="0 = greedy")
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=100_000, description="0 = off")
    min_p: float = Field(0.1, ge=0.0, lt=1.0, description="0 = off")
    max_tokens: int = Field(128, ge=1, le=32_768)
    seed: int | None = Field(0, ge=0, description="None = nondeterministic")
    ignore_eos: bool = Field(False, description="keep sampling past the stop token (benchmarks)")


def _describe_constraint(field_info) -> str:
    parts = []
    for meta in field_info.metadata:
        for attr, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{word} {value}")
    return " and ".join(parts)


def config_error(exc: ValidationError, model: type[BaseModel]) -> ConfigError:
    """Turn a pydantic error into one line per bad field: name, value, allowed range."""
    lines = []
    for err in exc.errors():
        name = ".".join(str(p) for p in err["loc"]) or model.__name__
        field = model.model_fields.get(str(err["loc"][0])) if err["loc"] else None
        allowed = _describe_constraint(field) if field is not None else ""
        got = err.get("input")
        rng = f" (allowed: {allowed})" if allowed else ""
        lines.append(f"{name}={got!r}: {err['msg'].lower()}{rng}")
    return ConfigError(
        "invalid setting: " + "; ".join(lines),
        hint="change the value to one inside the allowed range",
    )


def make_config(model: type[BaseModel], **values):
    """Build a settings model, raising ``ConfigError`` that names the bad field when invalid."""
    try:
        return model(**values)
    except ValidationError as exc:
        raise config_error(exc, model) from None


def update_config(cfg: BaseModel, **values):
    """A copy of ``cfg`` with ``values`` set and validated."""
    return make_config(type(cfg), **{**cfg.model_dump(), **values})
