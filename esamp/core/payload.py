"""The per-request ESamp payload as it travels through vLLM: a flat mapping of ``esamp*`` keys.

vLLM's OpenAI server hands a request's ``vllm_xargs`` (a flat mapping of strings and numbers) to
``SamplingParams.extra_args``; the library engine writes the same keys there. One form serves
both. What a user may send:

============================  ======================================================
``esamp``                     ``"on"`` / ``"off"`` (``Steering.enabled``)
``esamp_beta``                a number (``Steering.beta``)
``esamp_mix``                 a mix name (``Steering.mix``)
``esamp_train``               ``"on"`` / ``"off"``
``esamp_train_rows``          ``"all"`` / ``"group"``
``esamp_records``             ``"on"``: a server keeps this request's per-token novelty
                              records for a reader (``esamp.serving``)
============================  ======================================================

and what the engine adds (``prepare`` in the vLLM adapter, or the library engine):

============================  ======================================================
``esamp_group``               the prompt group: the n samples of one request share it
``esamp_sample``              the sample's index in its group
``esamp_seed``                the request's base seed (sample i of a seeded request has seed + i)
``esamp_n``                   the group's number of samples
``esamp_temperature``, ...    the request's real filters (vLLM itself is handed neutral ones)
============================  ======================================================

Steering values a request leaves out come from the engine's defaults (``EsampConfig``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from esamp.core.config import Filters, Steering, make_config
from esamp.errors import ConfigError, shown

PREFIX = "esamp"

# Steering field → payload key ("enabled" is the bare prefix: {"esamp": "off"}).
STEERING_KEYS = {name: PREFIX if name == "enabled" else f"{PREFIX}_{name}" for name in Steering.model_fields}
FILTER_KEYS = {name: f"{PREFIX}_{name}" for name in Filters.model_fields}
ROUTE_KEYS = {name: f"{PREFIX}_{name}" for name in ("group", "sample", "seed", "n", "records")}
KNOWN = frozenset({*STEERING_KEYS.values(), *FILTER_KEYS.values(), *ROUTE_KEYS.values()})
USER_KEYS = (*STEERING_KEYS.values(), ROUTE_KEYS["records"])


@dataclass(frozen=True)
class Payload:
    """One request's ESamp settings, validated. ``steering`` holds only what the request set."""

    steering: dict[str, Any] = field(default_factory=dict)
    filters: Filters | None = None
    group: str | None = None
    sample: int | None = None
    seed: int | None = None
    n: int | None = None
    records: bool | None = None

    def steering_over(self, defaults: Steering) -> Steering:
        """The request's steering, with what it left out taken from ``defaults``."""
        return defaults.model_copy(update=self.steering)

    @property
    def enabled(self) -> bool | None:
        return self.steering.get("enabled")

    def flat(self) -> dict[str, Any]:
        """This payload as ``extra_args`` carry it (``decode`` reads it back); booleans as "on"/"off"."""
        out: dict[str, Any] = {STEERING_KEYS[name]: _word(value) for name, value in self.steering.items()}
        if self.filters is not None:
            out.update({key: getattr(self.filters, name) for name, key in FILTER_KEYS.items()})
        for name in ("group", "sample", "seed", "n"):
            value = getattr(self, name)
            if value is not None:
                out[ROUTE_KEYS[name]] = value
        if self.records is not None:
            out[ROUTE_KEYS["records"]] = _word(self.records)
        return out


def encode(
    steering: Steering | None = None,
    *,
    group: str | None = None,
    sample: int | None = None,
    filters: Filters | None = None,
    seed: int | None = None,
    n: int | None = None,
    records: bool | None = None,
) -> dict[str, Any]:
    """The flat payload for ``extra_args`` / ``vllm_xargs`` (every field of ``steering``): ``Payload.flat``."""
    fields = {} if steering is None else {name: getattr(steering, name) for name in STEERING_KEYS}
    return Payload(steering=fields, filters=filters, group=group, sample=sample, seed=seed, n=n, records=records).flat()


def _word(value: Any) -> Any:
    return ("on" if value else "off") if isinstance(value, bool) else value


def decode(extra: Mapping[str, Any] | None) -> Payload | None:
    """The payload in ``extra`` (validated), or None when the request carries no ESamp keys.

    Raises ``ConfigError`` naming the key for an unknown key or a value out of range.
    """
    if not extra:
        return None
    given = {k: v for k, v in extra.items() if isinstance(k, str) and (k == PREFIX or k.startswith(PREFIX + "_"))}
    if not given:
        return None
    unknown = sorted(set(given) - KNOWN)
    if unknown:
        raise ConfigError(
            f"unknown ESamp setting {', '.join(shown(k, quote=False) for k in unknown)}",
            hint="per-request settings are " + ", ".join(USER_KEYS),
        )
    steering = {name: given[key] for name, key in STEERING_KEYS.items() if key in given}
    if steering:  # validate what was given (ranges, names); keep only those fields
        valid = make_config(Steering, {n: k for n, k in STEERING_KEYS.items()}, **steering)
        steering = {name: getattr(valid, name) for name in steering}
    filters = None
    if any(key in given for key in FILTER_KEYS.values()):
        filters = make_config(
            Filters,
            {n: k for n, k in FILTER_KEYS.items()},
            **{name: given[key] for name, key in FILTER_KEYS.items() if key in given},
        )
    route = {name: given.get(key) for name, key in ROUTE_KEYS.items()}
    for name in ("sample", "seed", "n"):
        value = route[name]
        if value is not None:
            try:
                route[name] = int(value)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"{ROUTE_KEYS[name]}={shown(value)}: not an integer", hint="leave it out; the engine sets it"
                ) from None
            if route[name] < 0:
                raise ConfigError(
                    f"{ROUTE_KEYS[name]}={shown(value)}: must be 0 or more", hint="leave it out; the engine sets it"
                )
    records = route["records"]
    if records is not None:
        records = make_config(_Switch, {"on": ROUTE_KEYS["records"]}, on=records).on
    group = route["group"]
    return Payload(
        steering=steering,
        filters=filters,
        group=None if group is None else str(group),
        sample=route["sample"],
        seed=route["seed"],
        n=route["n"],
        records=records,
    )


class _Switch(BaseModel):
    on: bool
