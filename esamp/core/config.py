"""Every ESamp setting once: its default, its range, what it means and how a user spells it.

- ``Filters``: the request's own sampling filters (temperature, top-k, top-p, min-p).
- ``SamplingConfig(Filters)``: a prompt group's sampling: n, max_tokens, seed, ignore_eos, stop.
- ``Steering``: how ESamp steers one prompt group: on/off, β, mix, training.
- ``EsampConfig(Steering)``: the engine-wide Distiller (a bank or one shared) and taps, and the
  default steering.

Every client builds them the same way and gets the same errors: command-line flags
(``add_flags`` / ``from_flags``), the dashboard, eval and bench settings, and the vLLM
per-request payload (``esamp.core.payload``) all go through one ``model_validate`` per model, and
``settings_error`` names the setting as the user wrote it (``--max-tokens``, ``esamp_beta``), what
was given and what is allowed.

The defaults are the settings of the published Pass@k matrix: T 0.8, top-p 0.95, min-p 0.1,
β 0.8 (docs/algorithm.md).
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from esamp.core import mixes
from esamp.core.mixes import MixName
from esamp.errors import ConfigError, shown

Optimizer = Literal["adam", "sgd"]
TrainRows = Literal["all", "group"]
DistillerMode = Literal["bank", "shared"]


def _flag(flag: str | None = None, **extra) -> dict:
    """Field metadata: the command-line spelling (default ``--field-name``), e.g. ``-n`` or a
    negated boolean (``negate=True``: the flag turns the setting off)."""
    return {"flag": flag, **extra} if flag else dict(extra)


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Filters(_Settings):
    """The request's own filters. ESamp keeps them: its candidates are exactly what they keep."""

    temperature: float = Field(0.8, ge=0.0, le=5.0, description="sampling temperature, 0 = greedy")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="nucleus: keep the most likely tokens up to this mass")
    top_k: int = Field(0, ge=0, le=100_000, description="keep the k most likely tokens, 0 = off")
    min_p: float = Field(0.1, ge=0.0, lt=1.0, description="keep tokens at least this share of the most likely, 0 = off")


def _stop_string(text: str) -> str:
    if not text:
        raise ValueError("a stop string cannot be empty; give the text that ends a sample, e.g. a newline")
    return text


class SamplingConfig(Filters):
    """How a prompt group samples: n samples, each up to ``max_tokens``, with the filters above."""

    n: int = Field(
        4, ge=1, le=64, description="samples of the prompt, decoded as one group", json_schema_extra=_flag("-n")
    )
    max_tokens: int = Field(128, ge=1, le=32_768, description="tokens per sample")
    seed: int | None = Field(0, ge=0, description="sampling seed: same seed, same tokens")
    ignore_eos: bool = Field(False, description="keep sampling past the stop token (benchmarks)")
    stop: list[Annotated[str, AfterValidator(_stop_string)]] = Field(
        default_factory=list,
        description="stop a sample where its text holds this string, which its text then leaves out "
        "(vLLM's stop); may be repeated",
        json_schema_extra=_flag(metavar="TEXT"),
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, stop: Any) -> Any:
        return [stop] if isinstance(stop, str) else stop  # one string is a list of one, as in vLLM


class Steering(_Settings):
    """How ESamp steers one prompt group. Engines take one per group (``engine.start``)."""

    enabled: bool = Field(
        True,
        description="steer with ESamp (off: plain sampling, no Distiller)",
        json_schema_extra=_flag("--no-esamp", negate=True, help="plain sampling: no Distiller, no novelty (ESamp off)"),
    )
    beta: float = Field(0.8, ge=0.0, le=10.0, description="ESamp strength; 0 samples exactly like ESamp off")
    mix: MixName = Field("paper", description="how the Distiller logits d enter: " + mixes.describe())
    train: bool = Field(
        True,
        description="train the Distiller while decoding (off: it keeps its initial weights)",
        json_schema_extra=_flag(
            "--no-train", negate=True, help="do not train the Distiller: it keeps its initial weights"
        ),
    )
    # "group" by default: its pass@k and diversity lie inside the intervals of "all" in every cell of
    # the committed quality table (docs/benchmarks.md), and it is what the published runtime trains.
    train_rows: TrainRows = Field(
        "group", description="rows that train the Distiller each step: one row per group, or all of a group's samples"
    )


class EsampConfig(_Settings):
    """The engine-wide ESamp settings: the Distiller and its taps, fixed when an engine starts,
    and ``steering``, the steering of a group that brings none of its own.

    ``distiller`` is engine-wide rather than per group: a shared Distiller is one set of weights
    that every group of the engine trains, so a group cannot have one of its own while the others
    share, and a per-request switch would let one request decide what every other request's
    Distiller is. ``slots`` counts prompt groups steered at once in both modes (the bank holds a
    Distiller per slot; the shared Distiller steers up to that many groups).

    The steering's fields may also be given flat (``EsampConfig(beta=1.2)``, command-line flags,
    an older JSON form): they go into ``steering``."""

    rank: int = Field(64, ge=1, le=1024, description="rank of the Distiller's low-rank residual")
    lr: float = Field(1e-3, gt=0.0, le=1.0, description="Distiller learning rate")
    optimizer: Optimizer = Field("adam", description="Distiller optimizer")
    source_layer: int = Field(0, description="decoder layer whose input norm is the source tap")
    target_layer: int = Field(-1, description="decoder layer whose input norm is the target tap (-1 = last)")
    distiller: DistillerMode = Field(
        "bank",
        description="bank: a Distiller per prompt group, novelty relative to its siblings; shared: one "
        "Distiller for every group, kept across groups (the published runtime's)",
    )
    slots: int = Field(64, ge=1, le=4096, description="Distiller slots: prompt groups steered at once")
    seed: int = Field(
        0, ge=0, description="seed of the Distiller's initial weights", json_schema_extra=_flag("--distiller-seed")
    )
    steering: Steering = Field(default_factory=Steering, description="the default steering of a group")

    @model_validator(mode="before")
    @classmethod
    def _nest_steering(cls, data: Any) -> Any:
        if isinstance(data, dict):
            flat = {k: v for k, v in data.items() if k in Steering.model_fields}
            if flat:
                nested = data.get("steering") or {}
                if isinstance(nested, Steering):
                    nested = nested.model_dump()
                data = {k: v for k, v in data.items() if k not in flat}
                data["steering"] = {**nested, **flat}
        return data

    @property
    def shared_distiller(self) -> bool:
        """Whether every group of the engine uses and trains one Distiller (``distiller="shared"``)."""
        return self.distiller == "shared"

    def engine_settings(self) -> dict[str, Any]:
        """The fields fixed when an engine starts (everything but the steering)."""
        return {k: getattr(self, k) for k in ENGINE_FIELDS}

    def flat(self) -> dict[str, Any]:
        """Every setting by its own name, the steering's beside the engine's (records, reports)."""
        return {**self.engine_settings(), **self.steering.model_dump()}

    def with_steering(self, **values) -> EsampConfig:
        """A copy whose default steering has ``values`` (validated)."""
        return self.model_copy(update={"steering": update_config(self.steering, **values)})


ENGINE_FIELDS = tuple(k for k in EsampConfig.model_fields if k != "steering")


def setting(config: BaseModel, field: str):
    """A setting's value by name (an ``EsampConfig``'s steering fields included)."""
    if field not in type(config).model_fields and "steering" in type(config).model_fields:
        return getattr(config.steering, field)
    return getattr(config, field)


def field_info(model: type[BaseModel], field: str):
    """A setting's field: the model's own, or its ``steering``'s (an ``EsampConfig`` takes the
    steering's fields flat too)."""
    if field in model.model_fields:
        return model.model_fields[field]
    if "steering" in model.model_fields and field in Steering.model_fields:
        return Steering.model_fields[field]
    raise KeyError(field)


def settings_fields(model: type[BaseModel]) -> list[str]:
    """Every setting a model takes by name (an ``EsampConfig``: its own and its steering's)."""
    own = [k for k in model.model_fields if not (k == "steering" and model is not Steering)]
    return own + (list(Steering.model_fields) if "steering" in model.model_fields else [])


# -- errors ----------------------------------------------------------------------------------


def _constraint(info) -> str:
    parts = []
    for meta in info.metadata:
        for attr, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{word} {value}")
    choices = _choices(info.annotation)
    if choices:
        parts.append("one of " + ", ".join(map(str, choices)))
    return " and ".join(parts)


def bound(model: type[BaseModel], field: str, which: str):
    """A field's limit (``which``: "ge", "gt", "le" or "lt"), or None: ranges are read, not restated."""
    for meta in field_info(model, field).metadata:
        value = getattr(meta, which, None)
        if value is not None:
            return value
    return None


def _choices(annotation) -> tuple | None:
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    return None


def settings_error(exc: ValidationError, model: type[BaseModel], names: Mapping[str, str] | None = None) -> ConfigError:
    """One line per bad setting: its name as the user wrote it, the value, what is allowed."""
    names = names or {}
    lines = []
    for err in exc.errors():
        loc = [p for p in err["loc"] if p != "steering"] if model is not Steering else list(err["loc"])
        field = str(loc[0]) if loc else ""
        try:
            info = field_info(model, field)
        except KeyError:
            info = None
        label = names.get(field, ".".join(str(p) for p in loc) or model.__name__)
        allowed = _constraint(info) if info is not None else ""
        if err["type"] == "extra_forbidden":
            known = ", ".join(names.get(k, k) for k in settings_fields(model))
            lines.append(f"{label}: unknown setting (known: {known})")
            continue
        rng = f" (allowed: {allowed})" if allowed else ""
        lines.append(f"{label}={shown(err.get('input'))}: {err['msg'].lower()}{rng}")
    return ConfigError("invalid setting: " + "; ".join(lines), hint="change the value to one inside the allowed range")


def make_config(model: type[BaseModel], names: Mapping[str, str] | None = None, **values):
    """Build a settings model; a bad value raises ``ConfigError`` naming it (as in ``names``)."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise settings_error(exc, model, names) from None


def update_config(cfg: BaseModel, names: Mapping[str, str] | None = None, **values):
    """A validated copy of ``cfg`` with ``values`` set."""
    return make_config(type(cfg), names, **{**cfg.model_dump(), **values})


# -- command-line flags ----------------------------------------------------------------------


def flag_of(model: type[BaseModel], field: str) -> str:
    """How ``field`` is spelled on the command line: ``--max-tokens``, ``-n``, ``--no-esamp``."""
    extra = field_info(model, field).json_schema_extra or {}
    return extra.get("flag") or "--" + field.replace("_", "-")


def _help(model: type[BaseModel], field: str, defaults: Mapping[str, Any] | None = None) -> str:
    info = field_info(model, field)
    extra = info.json_schema_extra or {}
    text = extra.get("help") or info.description or field
    if info.annotation is bool:
        return text
    rng = _constraint(info)
    default = defaults[field] if defaults and field in defaults else info.get_default(call_default_factory=True)
    default_text = "none" if default is None or default == [] else default
    return f"{text} ({rng + ', ' if rng and not _choices(info.annotation) else ''}default {default_text})"


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    fields: Iterable[str],
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add one flag per field of ``model``, typed and described from the field itself.

    Flags default to None ("not given"), so ``from_flags`` applies only what the user typed and
    every default stays the model's own (or ``defaults``, for a command with other defaults).
    """
    for field in fields:
        info = field_info(model, field)
        flag = flag_of(model, field)
        dest = field
        extra = info.json_schema_extra or {}
        if info.annotation is bool:
            action = "store_false" if extra.get("negate") else "store_true"
            parser.add_argument(flag, dest=dest, action=action, default=None, help=_help(model, field))
            continue
        if typing.get_origin(info.annotation) is list:  # a flag given once per value
            parser.add_argument(
                flag,
                dest=dest,
                action="append",
                type=_scalar(info.annotation),
                default=None,
                metavar=extra.get("metavar") or field.upper(),
                help=_help(model, field, defaults),
            )
            continue
        choices = _choices(info.annotation)
        kind = type(choices[0]) if choices else _scalar(info.annotation)
        help_text = _help(model, field, defaults)
        parser.add_argument(
            flag,
            dest=dest,
            type=kind,
            choices=choices,
            default=None,
            metavar=None if choices else field.split("_")[-1].upper(),
            help=help_text,
        )


def _scalar(annotation):
    for kind in (int, float, str):
        if annotation is kind or kind in typing.get_args(annotation):
            return kind
    return str


def from_flags(
    args: argparse.Namespace,
    model: type[BaseModel],
    fields: Iterable[str],
    defaults: Mapping[str, Any] | None = None,
    **fixed,
):
    """The model from the flags the user gave (``add_flags``), over ``defaults``; errors name flags."""
    fields = list(fields)
    values = dict(defaults or {})
    values.update({f: getattr(args, f) for f in fields if getattr(args, f, None) is not None})
    values.update(fixed)
    return make_config(model, {f: flag_of(model, f) for f in settings_fields(model)}, **values)
