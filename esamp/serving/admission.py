"""Whether a served request can be an ESamp group, decided before vLLM starts answering it.

vLLM checks a request's sampling parameters (our logits processor's ``validate_params``, that is
``esamp.engines.vllm.settings.prepare``) when the engine takes the request. For a streaming request
that happens after the server has answered 200 and opened the stream, so a refusal arrives as an
error event inside a successful response, which OpenAI clients do not treat as a bad request.
The middleware therefore runs the very same check (``settings.check`` and
``settings.refuse_server_keys``, which ``prepare`` runs) on the request body first and answers a
refusal as a 400 in the form vLLM uses for its own (``{"error": {"message", "type", "param",
"code"}}``). What the check accepts here, vLLM accepts later: they are the same functions.
The settings it decoded and checked go with the request's ticket (``Admission.settings``, held by
``settings.ISSUED``), so ``prepare`` does not decode them again.

The body is read as vLLM reads it: through vLLM's own request model (``CompletionRequest``,
``ChatCompletionRequest``), so a number sent as a string (``"n": "1000"``) is the number vLLM
will see, and gets the answer the non-streaming request gets. A body vLLM's model refuses passes
through for vLLM to answer (it does so before any stream opens). Two things vLLM would let through
are refused here: ``true``/``false`` where a number belongs (vLLM would read ``"n": true`` as 1),
and text with a lone UTF-16 surrogate (``"\\ud800"``), which no tokenizer can read.

A request field left out is checked as vLLM's neutral value; the server's defaults for it (the
model's ``generation_config.json``) are the server's choice and cannot be wrong per request
(``esamp serve`` neutralises the one default ESamp cannot steer, a repetition penalty).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from esamp.core import payload as pl
from esamp.core.config import Filters, Steering
from esamp.errors import EsampError, shown

if TYPE_CHECKING:
    from esamp.engines.vllm.settings import Admitted

PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
# vLLM's values for a field a request leaves out (before the server's defaults)
NEUTRAL = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, **PENALTIES}
# request fields that are numbers (true/false there is refused), and the numeric ESamp keys
NUMBERS = (*NEUTRAL, "max_tokens", "max_completion_tokens")
NUMERIC_KEYS = tuple(
    key for name, key in pl.STEERING_KEYS.items() if Steering.model_fields[name].annotation in (int, float)
)
NO_SEED = -1  # vLLM reads seed -1 as no seed


@dataclass(frozen=True)
class Admission:
    """What the middleware needs to route a request."""

    steered: bool  # an ESamp group (prepared); False: ESamp off, or nothing for ESamp to check
    n: int  # samples the request asks for (per prompt)
    prompts: int = 1  # prompts in the request: each is its own group
    records: bool = False  # the request asked for its novelty records (esamp_records: on)
    settings: Admitted | None = None  # what was checked, for the request's ticket (steered requests)


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
    """A body vLLM's own request validation answers (wrong types, missing fields): not ours to judge."""


def admit(body: Mapping[str, Any], chat: bool | None = None) -> Admission:
    """Check one completion or chat-completion body (``chat``: which; None: by its fields, as
    ``/invocations`` routes it); ``Refused`` if ESamp cannot serve it. A body vLLM itself will
    reject passes through for vLLM to answer."""
    _refuse_booleans(body)
    refuse_surrogates(body)
    try:
        request = _as_vllm_reads(body, ("messages" in body) if chat is None else chat)
    except _NotOurs:
        return Admission(steered=False, n=1)
    fields = {name: _value(request, name) for name in NEUTRAL}
    n = int(fields["n"])
    xargs = request.get("vllm_xargs")
    if xargs is None:
        xargs = {}
    if not isinstance(xargs, Mapping):
        return Admission(steered=False, n=n)
    params = SimpleNamespace(extra_args=dict(xargs), **fields)
    from esamp.engines.vllm.settings import (  # no vLLM import: the engine's own check
        Admitted,
        check,
        refuse_server_keys,
    )

    try:
        refuse_server_keys(xargs)  # any group a client names, running or not, gets this one answer
        payload = check(params)
    except (ValueError, EsampError) as exc:
        message = f"{exc.message} ({exc.hint})" if isinstance(exc, EsampError) and exc.hint else str(exc)
        raise Refused(message, _param(body, message)) from None
    if payload is None:
        return Admission(steered=False, n=n)
    prompts = _prompts(request)
    records = bool(payload.records)
    if records and prompts > 1:
        raise Refused(many_prompts_with_records(prompts), param="prompt")
    return Admission(
        steered=True, n=n, prompts=prompts, records=records, settings=Admitted(extra=params.extra_args, payload=payload)
    )


def many_prompts_with_records(prompts: int) -> str:
    return (
        f"esamp_records with {prompts} prompts in one request: each prompt is its own group, and records are "
        "read per request; send one prompt per request to read its records"
    )


def _value(request: Mapping[str, Any], name: str):
    value = request.get(name)
    if value is None or (name == "seed" and value == NO_SEED):
        return NEUTRAL[name]
    return value


def _as_vllm_reads(body: Mapping[str, Any], chat: bool) -> dict:
    """The body's fields as vLLM's request model makes them (strings to numbers, ...)."""
    try:
        if chat:
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as model
        else:
            from vllm.entrypoints.openai.completion.protocol import CompletionRequest as model
    except ImportError:  # outside vLLM (the middleware's own tests): numbers as sent
        return _plain(body)
    try:
        request = model.model_validate(dict(body))
    except Exception:  # vLLM answers it, with its own message, before any stream
        raise _NotOurs from None
    fields = {name: getattr(request, name, None) for name in NEUTRAL}
    return {**fields, "vllm_xargs": request.vllm_xargs, "prompt": getattr(request, "prompt", None)}


def _plain(body: Mapping[str, Any]) -> dict:
    out = {}
    for name in NEUTRAL:
        value = body.get(name)
        if isinstance(value, str):
            try:
                value = float(value) if any(c in value for c in ".eE") else int(value)
            except ValueError:
                raise _NotOurs from None
        elif value is not None and not isinstance(value, (int, float)):
            raise _NotOurs
        out[name] = value
    return {**out, "vllm_xargs": body.get("vllm_xargs"), "prompt": body.get("prompt")}


def _prompts(request: Mapping[str, Any]) -> int:
    """How many prompts a completion request holds (a chat request holds one)."""
    prompt = request.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def _refuse_booleans(body: Mapping[str, Any]) -> None:
    """``true``/``false`` where a number belongs (vLLM would take true as 1)."""
    for name in NUMBERS:
        if isinstance(body.get(name), bool):
            raise Refused(f"{name}={str(body[name]).lower()}: a number is needed, not true/false", param=name)
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, Mapping):
        for key in NUMERIC_KEYS:
            if isinstance(xargs.get(key), bool):
                raise Refused(
                    f"vllm_xargs {key}={str(xargs[key]).lower()}: a number is needed, not true/false",
                    param="vllm_xargs",
                )


def surrogate(value: Any, where: str = "") -> tuple[str, int, str] | None:
    """The first lone UTF-16 surrogate in a JSON value: (field, character position, the character)."""
    if isinstance(value, str):
        for i, ch in enumerate(value):
            if "\ud800" <= ch <= "\udfff":
                return where, i + 1, ch
        return None
    items = value.items() if isinstance(value, Mapping) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = surrogate(
            item, f"{where}.{key}" if where and isinstance(key, str) else f"{where}[{key}]" if where else str(key)
        )
        if found:
            return found
    return None


def refuse_surrogates(body: Mapping[str, Any]) -> None:
    """``Refused`` naming the first lone surrogate in a body's text, if any."""
    found = surrogate(body)
    if found:
        raise Refused(surrogate_message(*found), param=shown(found[0].split(".")[0].split("[")[0], quote=False))


def surrogate_message(field: str, position: int, ch: str) -> str:
    return (
        f"{shown(field, quote=False)}: character {position} is a lone UTF-16 surrogate (\\u{ord(ch):04x}), "
        "half of a character that is not text on its own; send the whole character (a surrogate pair in JSON, "
        "or the character itself in UTF-8), or drop it"
    )


def _param(body: Mapping[str, Any], message: str) -> str | None:
    """The request field a refusal is about, for the error's ``param``."""
    for name, neutral in PENALTIES.items():
        if body.get(name) not in (None, neutral) and "penalties" in message:
            return name
    named = re.match(r"(?:invalid setting: )?(?:vllm_xargs )?([a-z_]+)[=:, ]", message)
    if named:
        name = named.group(1)
        if name.startswith(pl.PREFIX):
            return "vllm_xargs"
        if name == "n" or name in Filters.model_fields:
            return name
    if pl.PREFIX in message:
        return "vllm_xargs"
    return None
