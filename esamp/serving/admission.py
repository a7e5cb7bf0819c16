"""Whether a served request can be an ESamp group, decided before vLLM starts answering it.

vLLM checks a request's sampling parameters (our logits processor's ``validate_params``, that is
``esamp.engines.vllm.settings.prepare``) when the engine takes the request. For a streaming request
that happens after the server has answered 200 and opened the stream, so a refusal arrives as an
error event inside a successful response, which OpenAI clients do not treat as a bad request.
The middleware therefore runs the very same ``prepare`` on the request body first and answers a
refusal as a 400 in the form vLLM uses for its own (``{"error": {"message", "type", "param",
"code"}}``). What ``prepare`` accepts here, vLLM accepts later: it is one function.

A request field left out is checked as vLLM's neutral value; the server's defaults for it (the
model's ``generation_config.json``) are the server's choice and cannot be wrong per request
(``esamp serve`` neutralises the one default ESamp cannot steer, a repetition penalty).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping

from esamp.core import payload as pl
from esamp.core.config import Filters

# What a request may put in vllm_xargs: the steering, whether to keep records, and its own group
# key (a client that reads its records names its group). The rest is the server's to set.
CLIENT_KEYS = frozenset({*pl.USER_KEYS, pl.ROUTE_KEYS["group"]})
PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
# vLLM's values for a field a request leaves out (before the server's defaults)
NEUTRAL = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, **PENALTIES}


@dataclass(frozen=True)
class Admission:
    """What the middleware needs to route a request."""

    steered: bool  # an ESamp group (prepared); False: ESamp off, or nothing for ESamp to check
    n: int  # samples the request asks for
    group: str | None = None  # the group key the client chose, if any


class Refused(Exception):
    """A request ESamp cannot serve: ``message`` says what to change, ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict:
        """The 400 body, shaped as vLLM's own errors (and the OpenAI API's)."""
        return {"error": {"message": self.message, "type": "BadRequestError", "param": self.param, "code": 400}}


class _NotOurs(Exception):
    """A field of the wrong type: vLLM's own request validation answers it, not us."""


def _field(body: Mapping[str, Any], name: str):
    value = body.get(name)
    if value is None:
        return NEUTRAL[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _NotOurs(name)
    return value


def admit(body: Mapping[str, Any]) -> Admission:
    """Check one ``/v1/completions`` or ``/v1/chat/completions`` body; ``Refused`` if ESamp cannot
    serve it. A body vLLM itself will reject (wrong types) passes through for vLLM to answer."""
    try:
        fields = {name: _field(body, name) for name in NEUTRAL}
    except _NotOurs:
        return Admission(steered=False, n=1)
    n = int(fields["n"])
    xargs = body.get("vllm_xargs")
    if xargs is None:
        xargs = {}
    if not isinstance(xargs, Mapping):
        return Admission(steered=False, n=n)
    engine_keys = sorted(k for k in xargs if isinstance(k, str) and k in pl.KNOWN and k not in CLIENT_KEYS)
    if engine_keys:
        raise Refused(f"vllm_xargs {', '.join(engine_keys)}: set by the server, not by a request; send the "
                      "request's own fields (temperature, top_p, top_k, min_p, seed, n) instead, and in "
                      "vllm_xargs only " + ", ".join(sorted(CLIENT_KEYS)), param="vllm_xargs")
    params = SimpleNamespace(extra_args=dict(xargs), **fields)
    from esamp.engines.vllm.settings import prepare  # no vLLM import: the engine's own check

    try:
        prepare(params)
    except ValueError as exc:
        raise Refused(str(exc), _param(body, str(exc))) from None
    payload = pl.decode(params.extra_args)
    if payload is None or payload.filters is None:
        return Admission(steered=False, n=n)
    client_group = xargs.get(pl.ROUTE_KEYS["group"])
    return Admission(steered=True, n=n, group=None if client_group is None else str(client_group))


def _param(body: Mapping[str, Any], message: str) -> str | None:
    """The request field a refusal is about, for the error's ``param``."""
    for name, neutral in PENALTIES.items():
        if body.get(name) not in (None, neutral):
            return name
    named = re.match(r"(?:invalid setting: )?([a-z_]+)=", message)
    if named:
        name = named.group(1)
        if name.startswith(pl.PREFIX):
            return "vllm_xargs"
        if name == "n" or name in Filters.model_fields:
            return name
    if pl.PREFIX in message:
        return "vllm_xargs"
    return None
