"""The cells of ``esamp eval``: sets of ESamp settings, each compared with one shared baseline.

A cell is one complete ``EsampConfig``. ``--matrix beta=0.4,0.8 mix=paper,unsharpened`` makes the
cross product of the listed values (four cells), each over the settings given by the other flags;
without ``--matrix`` there is one cell, named ``esamp``. The baseline (ESamp off) is sampled once
per problem and every cell is compared with it on the same seeds, so k cells cost k + 1 arms.

Matrix keys are of two sorts (``esamp.core.config``):

- per-group steering (``Steering``: beta, mix, train, train_rows): cells that differ only there
  share one engine, each prompt group carrying its own ``Steering``;
- engine-wide settings (optimizer, lr, rank, tap layers, the Distiller bank or a shared one):
  fixed when an engine starts, so each distinct combination gets its own engine
  (``engine_groups``), started one after another. A shared Distiller keeps learning across the
  groups of its engine, so every cell with one gets an engine of its own: what it samples then
  depends on its own groups only, not on which other cells the run holds.

Values are validated by the settings models themselves, so a bad one names the key and its
allowed range exactly as ``esamp generate`` would.

Beside the cells, a run may hold *plain arms* (``--plain temperature=0.4,1.2,1.6``): plain
sampling, ESamp off, with filters of their own (temperature, top-p, top-k, min-p), on the same
problems and seeds. They are the baselines a sampler has to beat: the baseline and the plain arms
that differ from it only in temperature make the temperature curve (``esamp.eval.frontier``).
Every ``--plain`` is a cross product of its own, so ``--plain temperature=1.5,2 top_p=1 min_p=0.1``
beside a temperature sweep adds min-p at high temperature.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from esamp.core.config import ENGINE_FIELDS, EsampConfig, Filters, SamplingConfig, Steering, make_config, setting
from esamp.core.mixes import MIXES
from esamp.errors import ConfigError

BASELINE = "baseline"
SINGLE = "esamp"  # the name of the one cell of a run without --matrix

STEERING_KEYS = tuple(k for k in Steering.model_fields if k != "enabled")
ENGINE_KEYS = ("optimizer", "lr", "rank", "source_layer", "target_layer", "distiller")
MATRIX_KEYS = STEERING_KEYS + ENGINE_KEYS
PLAIN_KEYS = tuple(Filters.model_fields)  # what a plain arm may set: its filters
# Bank capacity changes no sample, so it is not part of what a cell is.
NOT_RECORDED = frozenset({"slots"})


@dataclass(frozen=True)
class Cell:
    name: str
    config: EsampConfig

    @property
    def steering(self) -> Steering:
        return self.config.steering

    @property
    def engine_key(self) -> tuple:
        """Cells with equal keys share an engine: their engine-wide settings, and for a shared
        Distiller (which learns from every group its engine steers) the cell itself."""
        key = tuple(getattr(self.config, k) for k in ENGINE_FIELDS)
        return key + (self.name,) if self.config.shared_distiller else key

    def record(self) -> dict[str, Any]:
        """What run.json stores of this cell: every setting that can change a sample."""
        return {k: v for k, v in self.config.flat().items() if k not in NOT_RECORDED}


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return repr(value) if isinstance(value, float) else str(value)


def _split(text: str, origin: str) -> tuple[str, list[str]]:
    key, sep, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key:
        raise ConfigError(
            f"{origin} {text!r} is not KEY=VALUE[,VALUE...]",
            hint=f"write it like --matrix beta=0.4,0.8,1.2 mix={','.join(MIXES)}",
        )
    parts = [v.strip() for v in values.split(",")]
    if not all(parts):
        raise ConfigError(
            f"{origin} {text!r} has an empty value", hint="separate values with single commas, e.g. beta=0.4,0.8"
        )
    return key, parts


def parse_axes(items: Sequence[str], origin: str = "--matrix") -> dict[str, list]:
    """``["beta=0.4,0.8", "mix=paper"]`` as ``{"beta": ["0.4", "0.8"], "mix": ["paper"]}`` (raw)."""
    axes: dict[str, list] = {}
    for item in items:
        key, values = _split(item, origin)
        if key in axes:
            raise ConfigError(f"{origin} names {key} twice", hint=f"list every value of {key} once: {key}=A,B")
        axes[key] = values
    return axes


def _check_axes(
    axes: Mapping[str, Iterable],
    keys: Sequence[str],
    model: type[BaseModel],
    base: Mapping[str, Any],
    origin: str,
    unknown_hint: str,
    example: str = "A,B",
) -> dict[str, list]:
    """Each key checked against ``keys`` and each value against its field of ``model`` (over the
    settings ``base``), so a bad one is refused as its flag would be; every value listed once."""
    out: dict[str, list] = {}
    for key, raw_values in axes.items():
        if key not in keys:
            raise ConfigError(f"{origin}: unknown key {key!r}", hint=unknown_hint)
        raw_values = list(raw_values) if isinstance(raw_values, (list, tuple)) else [raw_values]
        if not raw_values:
            raise ConfigError(f"{origin} {key} lists no values", hint=f"e.g. {key}={example}")
        values = []
        for raw in raw_values:
            value = setting(make_config(model, {key: f"{origin} {key}"}, **{**base, key: raw}), key)
            if value in values:
                raise ConfigError(f"{origin} {key} lists {format_value(value)} twice", hint="list every value once")
            values.append(value)
        out[key] = values
    return out


def validate_axes(axes: Mapping[str, Iterable], base: EsampConfig, origin: str = "--matrix") -> dict[str, list]:
    """The matrix's axes (``MATRIX_KEYS``), each value checked against its settings field."""
    return _check_axes(
        axes, MATRIX_KEYS, EsampConfig, base.flat(), origin, unknown_hint="matrix keys: " + ", ".join(MATRIX_KEYS)
    )


def _combinations(axes: Mapping[str, Sequence]) -> list[tuple[str, dict]]:
    """The cross product of ``axes``: each combination's name (``beta=0.4,mix=paper``) and values."""
    keys = list(axes)
    out = []
    for combo in itertools.product(*(axes[k] for k in keys)):
        values = dict(zip(keys, combo))
        out.append((",".join(f"{k}={format_value(v)}" for k, v in values.items()), values))
    return out


def build_cells(axes: Mapping[str, Sequence], base: EsampConfig) -> list[Cell]:
    """The cross product of ``axes`` over ``base``; without axes, the one cell ``esamp``."""
    if not axes:
        return [Cell(SINGLE, base)]
    return [Cell(name, make_config(EsampConfig, **{**base.flat(), **values})) for name, values in _combinations(axes)]


def engine_groups(cells: Sequence[Cell]) -> list[tuple[EsampConfig, list[Cell]]]:
    """Cells grouped by their engine-wide settings, in order of first appearance: one engine each."""
    groups: dict[tuple, list[Cell]] = {}
    for cell in cells:
        groups.setdefault(cell.engine_key, []).append(cell)
    return [(members[0].config, members) for members in groups.values()]


# -- plain arms ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlainArm:
    """Plain sampling (ESamp off) with its own filters: ``filters`` replaces those of the task's
    sampling, everything else (n, max tokens, seeds) is shared with every arm."""

    name: str
    filters: dict

    def sampling(self, base: SamplingConfig) -> SamplingConfig:
        return base.model_copy(update=self.filters)

    def record(self) -> dict[str, Any]:
        return dict(self.filters)


def build_plain_arms(
    specs: Sequence[Mapping[str, Iterable]], base: SamplingConfig, origin: str = "--plain"
) -> list[PlainArm]:
    """Each spec's cross product of filter values, checked like flags. Arms are named by what
    they set (``temperature=1.2``); ``EvalSettings`` refuses one that samples like another or like
    the baseline."""
    hint = "plain arms set their filters: " + ", ".join(PLAIN_KEYS) + " (ESamp settings go to --matrix)"
    return [
        PlainArm(name, filters)
        for spec in specs
        for name, filters in _combinations(
            _check_axes(
                spec, PLAIN_KEYS, SamplingConfig, base.model_dump(), origin, unknown_hint=hint, example="0.4,1.2"
            )
        )
    ]
