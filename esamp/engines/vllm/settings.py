"""How ESamp settings travel through vLLM. No vLLM import at module level.

Two channels, both public:

- Engine-wide settings (taps, the Distiller bank, default steering) are ``EsampConfig`` in
  ``additional_config={"esamp": {...}}`` (``--additional-config`` for ``vllm serve``). vLLM hashes
  that dict into its compile-cache key, so a change of tap layers never reuses a graph traced for
  other layers.
- Per-request settings are the flat payload of ``esamp.core.payload`` in
  ``SamplingParams.extra_args`` (``vllm_xargs`` in an OpenAI request).

``prepare`` runs in vLLM's frontend (the logits processor's ``validate_params``) on every request,
before vLLM fans a request with n > 1 out into n child requests. For a request ESamp steers it
gives the request its group (so the n children share one Distiller slot), records n and the
base seed (child i of a seeded request has seed + i, which names its sample), and hands the
request's real filters to ESamp (``hand_filters_to_esamp``: they move into the payload and vLLM
gets neutral ones). A request the engine cannot serve (penalties, bad values) is refused with a
``ValueError`` that vLLM answers as a 400.

A request's settings are parsed into their typed form (``esamp.core.payload.Payload``) once, where
they enter, and stay typed until the one place they must be flat, ``SamplingParams.extra_args``
(vLLM's only public way from its frontend to the engine core, across a process boundary):

- served: the middleware's admission decodes the request's ``vllm_xargs`` and checks them
  (``check``) before vLLM builds its ``SamplingParams``, and the ticket it issues holds what it
  checked (``Admitted``) for the request's life. ``prepare`` takes that instead of decoding again,
  when the params carry exactly the ``vllm_xargs`` admission read (as the middleware wrote them);
  otherwise (a route whose body the middleware does not read, or ``extra_args`` vLLM added to) it
  decodes them itself.
- the library engine hands ``prepare`` its settings typed (``prepare(params, settings=...)``).

``prepare`` writes the flat payload once, and the engine core decodes it once per child request
(``rows.request_row``: vLLM hands each of the n children its own copy; a decode costs tens of
microseconds once per request, and a cache of decoded payloads would outlive the requests).
What ``prepare`` reads from the params every time, never from what admission saw: n, the filters,
the seed and the penalties. vLLM fills the fields a request leaves out with the server's defaults
(the model's ``generation_config``) after admission, so the values on the params are those the
engine runs with: they are checked again (no decode), and the filters handed to ESamp are those.

Which requests ``prepare`` steers: those carrying ESamp keys (not ``esamp=off``), and, in a
server started by ``esamp serve`` (``SERVE_ENV`` set), every other request too, with the server's
defaults.

In a server, group identity is the server's, never a client's (docs/serving.md, "Security"): a client
may send only the steering keys and ``esamp_records``. The API server's middleware issues each
request it steers a group (``ISSUED``): a public id, returned to the client in ``X-Esamp-Group``,
and a private ticket, written into the request's ``vllm_xargs`` and never shown to anyone.
``prepare`` steers a request only if it carries a ticket issued in this process for a request in
flight, and refuses every key the engine sets (the group, the filters, ``esamp_sample``,
``esamp_seed``, ``esamp_n``) unless ``prepare`` itself wrote them on these very params. What a
client can know (its own group's public id, any other string) is never a ticket, so every group a
client names gets the same refusal, whether or not that group is running. A request without a
ticket (a route the middleware does not steer, such as ``/generative_scoring``) is sampled plainly:
it holds no Distiller slot, so a slot is only ever held by a group whose request the middleware
is serving and will free when that request ends. So no request can join, train or read another
request's group, and nothing a client sends outlives its request (the settings held with a ticket
go with it at ``IssuedGroups.end``).
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

from esamp.core import payload as pl
from esamp.core.config import EsampConfig, Filters, SamplingConfig, Steering, bound, make_config
from esamp.engines.base import resolve_layer
from esamp.errors import ConfigError, EsampError

KEY = "esamp"  # additional_config["esamp"]: EsampConfig
SERVER_KEY = "esamp_server"  # additional_config["esamp_server"]: what ``esamp serve`` adds
SERVE_ENV = "ESAMP_SERVE"  # set by ``esamp serve``: ordinary requests are steered too
CLIENT_KEYS = frozenset(pl.USER_KEYS)  # what a served request may put in vllm_xargs; the rest is the server's
GROUP_ID_BYTES = 16  # random bytes in a server-issued group id (128 bits: not guessable)

# base architecture → the ESamp subclass registered for it
ARCHITECTURES = {
    "LlamaForCausalLM": "EsampLlamaForCausalLM",
    "Qwen2ForCausalLM": "EsampQwen2ForCausalLM",
    "Gemma3ForCausalLM": "EsampGemma3ForCausalLM",
}


def esamp_architecture(base: str) -> str:
    try:
        return ARCHITECTURES[base]
    except KeyError:
        raise ConfigError(
            f"ESamp on vLLM does not support the architecture {base!r} yet",
            hint="supported: " + ", ".join(ARCHITECTURES) + "; or use --engine reference",
        ) from None


def engine_settings(esamp: EsampConfig, num_layers: int) -> dict[str, Any]:
    """The ``additional_config["esamp"]`` dict: the whole config, taps resolved to 0..L-1."""
    out = esamp.flat()
    out["source_layer"] = resolve_layer(esamp.source_layer, num_layers, "source")
    out["target_layer"] = resolve_layer(esamp.target_layer, num_layers, "target")
    return out


def engine_config(vllm_config) -> EsampConfig | None:
    """This engine's ESamp settings, or None when the engine runs without ESamp."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get(KEY) if isinstance(extra, dict) else None
    if raw is None:
        return None
    if isinstance(raw, str):  # --additional-config '{"esamp": "{...}"}'
        raw = json.loads(raw)
    return make_config(EsampConfig, **raw)


def server_settings(vllm_config) -> dict[str, Any]:
    """What ``esamp serve`` wrote for this engine (``additional_config["esamp_server"]``: its side
    channel, which records to keep), or {} for an engine it did not start."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get(SERVER_KEY) if isinstance(extra, dict) else None
    if isinstance(raw, str):
        raw = json.loads(raw)
    return raw or {}


def neutral_filters(temperature: float) -> dict[str, Any]:
    """What vLLM itself applies to a steered row: nothing but greedy-or-not."""
    return dict(temperature=0.0 if temperature == 0 else 1.0, top_p=1.0, top_k=0, min_p=0.0)


def request_settings(group: str, sample: int, steering: Steering) -> pl.Payload:
    """The library engine's settings for one sample of a group, typed, for ``prepare(params,
    settings=...)`` (the filters stay on the params: ``prepare`` hands them over, as for a served
    request)."""
    return pl.Payload(steering={name: getattr(steering, name) for name in pl.STEERING_KEYS}, group=group, sample=sample)


def hand_filters_to_esamp(params, filters: Filters) -> None:
    """The filter hand-over, the one place a request's filters change: ``filters`` (the request's
    own temperature, top_p, top_k and min_p, as ``prepare`` read them from ``params``) go into its
    ESamp payload (``params.extra_args``), and vLLM gets neutral ones (``neutral_filters``; a greedy
    request stays greedy). ESamp's processor applies the real filters itself before the mix, and
    vLLM's sampler, which draws after the processor, must not filter the mixed distribution again:
    the mix is exact on the filtered candidates, and this is what lets ESamp's own filter stand in
    for vLLM's sort. ``prepare`` calls it (from vLLM's ``validate_params``) for every request it
    steers."""
    params.extra_args = {**(params.extra_args or {}), **pl.encode(filters=filters)}
    for name, value in neutral_filters(filters.temperature).items():
        setattr(params, name, value)


def _filters_of(params) -> Filters:
    top_k = int(params.top_k or 0)
    return make_config(
        Filters,
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=top_k if top_k > 0 else 0,
        min_p=float(params.min_p or 0.0),
    )


@dataclass(frozen=True)
class Admitted:
    """A served request's settings as the middleware's admission checked them: its ``vllm_xargs``
    (as vLLM's request model reads them, without the ticket) and their typed payload (``check``'s
    answer). Held with the request's ticket, so that ``prepare`` does not decode them again."""

    extra: dict[str, Any]
    payload: pl.Payload


@dataclass(frozen=True)
class Issued:
    """A steered request's group: ``group`` is its public id (the client reads its records with it),
    ``ticket`` the private proof, written into the request, that the middleware issued it."""

    group: str
    ticket: str


class IssuedGroups:
    """Groups the API server's middleware issued to the requests it is serving (this process).

    ``issue`` makes a request's group, holding the settings its admission checked; ``settings`` is
    ``prepare`` reading them back, and ``take`` claiming the group, by its ticket, for one prompt of
    that request (a request with several prompts gets ``ID``, ``ID.1``, ``ID.2``, ...: one group per
    prompt); ``end`` forgets the request, its settings with it, and returns the groups it became,
    for their Distiller slots to be freed. Only requests in flight are held: nothing outlives its
    request. ``prepare`` runs on vLLM's renderer threads, hence the lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # ticket → (public id, groups taken, the settings admission checked)
        self._groups: dict[str, tuple[str, list[str], Admitted | None]] = {}

    def issue(self, settings: Admitted | None = None) -> Issued:
        issued = Issued(
            group="eg-" + secrets.token_urlsafe(GROUP_ID_BYTES), ticket="et-" + secrets.token_urlsafe(GROUP_ID_BYTES)
        )
        with self._lock:
            self._groups[issued.ticket] = (issued.group, [], settings)
        return issued

    def settings(self, ticket: str) -> Admitted | None:
        """The settings held for the request holding ``ticket`` (None: none held, or not issued here
        or ended)."""
        with self._lock:
            held = self._groups.get(ticket)
            return None if held is None else held[2]

    def take(self, ticket: str) -> str | None:
        """The group for the next prompt of the request holding ``ticket``; None when ``ticket`` was
        not issued here or its request has ended."""
        with self._lock:
            held = self._groups.get(ticket)
            if held is None:
                return None
            token, groups, _ = held
            group = token if not groups else f"{token}.{len(groups)}"
            groups.append(group)
            return group

    def end(self, ticket: str) -> list[str]:
        with self._lock:
            return self._groups.pop(ticket, ("", [], None))[1]

    def __contains__(self, ticket: object) -> bool:
        return ticket in self._groups

    def __len__(self) -> int:
        return len(self._groups)


ISSUED = IssuedGroups()
# The params ``prepare`` made ESamp requests of, by id (weakly: nothing is kept once vLLM drops them).
_PREPARED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def refuse_server_keys(extra) -> None:
    """In a server: a ``ValueError`` for any key only the server may set (see the module docstring)."""
    engine_keys = sorted(
        k
        for k in extra
        if isinstance(k, str) and k in pl.KNOWN and k not in CLIENT_KEYS and k != pl.ROUTE_KEYS["group"]
    )
    if engine_keys:
        raise ValueError(
            f"vllm_xargs {', '.join(engine_keys)}: set by the server, not by a request; send the "
            "request's own fields (temperature, top_p, top_k, min_p, seed, n) instead, and in "
            "vllm_xargs only " + ", ".join(sorted(CLIENT_KEYS))
        )
    if pl.ROUTE_KEYS["group"] in extra:
        raise ValueError(
            f"vllm_xargs {pl.ROUTE_KEYS['group']}: set by the server, not by a request (each request "
            "is its own group); leave it out and read the group's id from the response's "
            "X-Esamp-Group header"
        )


def prepare(params, *, settings: pl.Payload | None = None) -> None:
    """Make ``params`` (a vLLM ``SamplingParams``) an ESamp request, or leave it alone. See the
    module docstring. Idempotent: a prepared request passes through unchanged. ``settings``: the
    library engine's own typed settings for this request, taken as they are (nothing is decoded);
    vLLM's ``validate_params`` passes only ``params``, whose ``extra_args`` are then the settings."""
    if _PREPARED.get(id(params)) is params:
        return  # prepared already (vLLM may validate a request more than once)
    ticket = None
    if settings is not None:
        extra, payload, served = settings.flat(), settings, False
    else:
        extra = params.extra_args or {}
        served = bool(os.environ.get(SERVE_ENV))
        given = extra.get(pl.ROUTE_KEYS["group"])
        ticket = given if isinstance(given, str) and given in ISSUED else None
        if ticket is not None:
            extra = {k: v for k, v in extra.items() if k != pl.ROUTE_KEYS["group"]}
        if served:
            refuse_server_keys(extra)
            if ticket is None:
                _refuse_unsteerable(extra)
                return  # no group of the server's: sampled plainly, holding no Distiller slot
        payload = _client_settings(extra, ticket)
    steered = _steerable(params, payload, served)
    if steered is None:
        if ticket is not None:
            params.extra_args = extra or None  # not steered after all: the ticket goes with nothing else
        return
    payload, filters = steered
    group = ISSUED.take(ticket) if ticket is not None else None
    if group is None:
        group = payload.group if payload.group else uuid.uuid4().hex
    # The base seed names the samples (child i has seed + i). vLLM takes any integer as a seed (and
    # -1 as none); a negative one is not a sample name, so those samples are numbered as they arrive.
    seed = params.seed
    params.extra_args = {
        **extra,
        **pl.encode(
            n=_samples(params),
            group=group,
            seed=seed if seed is not None and seed >= 0 and payload.sample is None else None,
        ),
    }
    hand_filters_to_esamp(params, filters)
    try:
        _PREPARED[id(params)] = params
    except TypeError:  # params that take no weak reference: prepared twice is then refused in a server
        pass


def check(params, extra: dict | None = None, served: bool | None = None) -> pl.Payload | None:
    """Whether ESamp steers a request with these ``params`` (and ``extra``, its ``extra_args`` without
    the server's ticket), without changing anything: its payload when it is steered, None when it
    is not (no ESamp keys outside a server, or ``esamp: off``). A ``ValueError`` that says what to
    change for a request ESamp cannot serve. ``served``: whether this process is ``esamp serve``'s
    server, where every request the middleware issues a group is steered (default: from the
    environment). The middleware's admission runs this very check before vLLM answers."""
    extra = (params.extra_args or {}) if extra is None else extra
    served = bool(os.environ.get(SERVE_ENV)) if served is None else served
    steered = _steerable(params, _decoded(extra), served)
    return None if steered is None else steered[0]


def _client_settings(extra: dict, ticket: str | None) -> pl.Payload | None:
    """The payload of ``extra``: the one admission checked when the ticket holds it for exactly these
    keys (as the middleware wrote them), else decoded here."""
    held = ISSUED.settings(ticket) if ticket is not None else None
    if held is not None and held.extra == extra:
        return held.payload
    return _decoded(extra)


def _decoded(extra) -> pl.Payload | None:
    try:
        return pl.decode(extra)
    except EsampError as exc:
        raise ValueError(f"{exc.message} ({exc.hint})") from None


def _steerable(params, payload: pl.Payload | None, served: bool) -> tuple[pl.Payload, Filters] | None:
    """``check`` on a payload decoded already: the payload and the request's filters (read from
    ``params``) when ESamp steers it, else None; a ``ValueError`` for what ESamp cannot serve."""
    if payload is None and not served:
        return None
    if payload is not None and payload.enabled is False:
        return None
    if payload is not None and payload.filters is not None:
        return None  # prepared by the caller (the library engine does not, but may)
    if params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        raise ValueError(
            "ESamp cannot steer a request with repetition, presence or frequency "
            "penalties (they would act after steering): drop them, or send "
            'vllm_xargs {"esamp": "off"} for plain sampling'
        )
    n = _samples(params)
    most = bound(SamplingConfig, "n", "le")
    if n < 1:  # named as the client sent it, before it becomes the engine's esamp_n
        raise ValueError(f"n={n}: a request asks for at least 1 sample; send n from 1 to {most}")
    if n > most:
        raise ValueError(
            f"n={n}: an ESamp group holds at most {most} samples; send fewer, or split them over several requests"
        )
    try:
        filters = _filters_of(params)
    except EsampError as exc:
        raise ValueError(f"{exc.message} ({exc.hint})") from None
    return payload or pl.Payload(), filters


def _samples(params) -> int:
    n = getattr(params, "n", None)
    return 1 if n is None else int(n)


def _refuse_unsteerable(extra) -> None:
    """In a server, a request the middleware issued no group (a route it does not steer) is sampled
    plainly; one that asks for ESamp by its keys is told so rather than silently sampled plainly."""
    payload = _decoded(extra)
    if payload is not None and payload.enabled is not False:
        keys = ", ".join(sorted(k for k in extra if isinstance(k, str) and k in pl.KNOWN))
        raise ValueError(
            f"vllm_xargs {keys}: this route is served without ESamp (it cannot carry the server's "
            "group); send the request to /v1/completions or /v1/chat/completions for ESamp, or "
            'leave the esamp keys out (docs/serving.md, "Requests")'
        )
