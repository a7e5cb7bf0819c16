"""What every engine shares: the group lifecycle, streaming bookkeeping, guards, step stats.

An engine runs prompt groups. ``start`` admits a group of n samples, each ``step`` advances every
running group by one token and returns the events of that step, ``abort`` ends a group early.
``EngineBase`` owns what is the same everywhere (settings per group, prompt encoding, the group
table, abort and close, stop tokens, layer checks, the step event); an engine supplies how it
admits, decodes, cancels and releases a group. Engines emit events only through ``GroupStream``,
so the token/novelty/done rules are the same everywhere (see ``esamp.events``).
"""

from __future__ import annotations

import collections
import itertools
import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from esamp.core.config import EsampConfig, SamplingConfig, Steering
from esamp.core.novelty import NoveltyNormalizer
from esamp.errors import ConfigError, EngineError, PromptError
from esamp.events import DoneEvent, ErrorEvent, Event, ReadyEvent, StepEvent, TokenEvent

_group_counter = itertools.count()


def group_key(*parts: object) -> str:
    """The group keys esamp makes from names: the parts joined by ``-`` (the dashboard's ``r3-on``,
    the library's fresh keys), usable as dashboard widget ids (letters, digits, ``-``, ``_``).
    Keys are opaque to engines, which refuse a key that is already running. ``esamp eval`` joins
    a problem id and an arm with ``|`` instead (``eval.runner.arm_group_key``: both hold ``-``)."""
    return "-".join(str(p) for p in parts)


def new_group_key(prefix: str = "g") -> str:
    """A fresh key for a caller that names no group."""
    return group_key(f"{prefix}{next(_group_counter)}", f"{time.monotonic_ns() % 1_000_000:06d}")


class Engine(Protocol):
    name: str

    @property
    def ready(self) -> ReadyEvent: ...

    def start(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingConfig,
        steering: Steering | None = None,
        group: str | None = None,
        chat: bool = True,
    ) -> str: ...

    @property
    def has_chat_template(self) -> bool: ...

    def step(self) -> list[Event]: ...

    def abort(self, group: str) -> list[Event]: ...

    def has_unfinished(self) -> bool: ...

    def close(self) -> None: ...


_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad"), None)


def check_prompt_text(prompt: str) -> str:
    """The prompt if it is text a model can read; a ``PromptError`` a user can act on otherwise.

    A prompt typed in a terminal with a non-UTF-8 locale, or passed with ``$(printf '\\xff')``,
    reaches Python with surrogate escapes (``\\udcff``) that no tokenizer accepts. A prompt of
    only whitespace, NUL, control or zero-width characters is empty to the model.
    """
    for i, ch in enumerate(prompt):
        if "\ud800" <= ch <= "\udfff":
            raw = f" (byte 0x{ord(ch) - 0xDC00:02x})" if "\udc80" <= ch <= "\udcff" else ""
            raise PromptError(
                f"the prompt is not valid UTF-8 text: character {i + 1}{raw} cannot be read",
                hint="retype the prompt, or convert it to UTF-8 (iconv -t UTF-8)",
            )
    visible = "".join(ch for ch in prompt.translate(_INVISIBLE) if ch.isprintable() and not ch.isspace())
    if not visible:
        raise PromptError("the prompt is empty", hint="type a question or an instruction")
    return prompt


def has_chat_template(tokenizer) -> bool:
    """Whether text prompts go through the model's chat template (``encode_prompt``): a pretrained
    base model's tokenizer usually has none, and its prompts then go in as they are."""
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, prompt: str | Sequence[int], chat: bool, context: int) -> list[int]:
    """Prompt → token ids: text through the chat template (when the model has one), or ids as
    given. Empty prompts and prompts that fill the context are errors a user can act on."""
    if not isinstance(prompt, str):
        ids = [int(t) for t in prompt]
    else:
        check_prompt_text(prompt)
        if chat and has_chat_template(tokenizer):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise PromptError("the prompt is empty", hint="type a question or an instruction")
    if len(ids) >= context:
        raise PromptError(
            f"the prompt is {len(ids)} tokens, longer than the model's context of {context}",
            hint=f"shorten the prompt to under {context} tokens",
        )
    return ids


def run(engine: Engine, prompt, sampling: SamplingConfig, steering: Steering | None = None, **kw) -> Iterator[Event]:
    """Start one group and yield its events until every sample is done."""
    group = engine.start(prompt, sampling, steering, **kw)
    try:
        while engine.has_unfinished():
            yield from engine.step()
    except BaseException:
        engine.abort(group)
        raise


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """``ids → tokenizer.decode(ids, skip_special_tokens=True)``, by the shortest way that gives it.

    A fast tokenizer that does not clean up spaces decodes with its Rust tokenizer alone; calling
    that directly skips the Python around it in transformers (three quarters of a token's time:
    every sampled token is decoded twice). A tokenizer that maps ids itself (``StandInTokenizer``)
    says so with a ``text_decoder`` of its own; anything else goes through ``decode``.
    """
    own = getattr(tokenizer, "text_decoder", None)
    if callable(own):
        return own()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", None) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding the whole list."""

    def __init__(self, tokenizer, prompt_tail: Sequence[int] = ()) -> None:
        self._decode = text_decoder(tokenizer) if tokenizer is not None else None
        self.ids: list[int] = list(prompt_tail)[-4:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self._decode
        if decode is None:
            return ""
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""


# ``TokenEvent(**fields)`` without ``BaseModel.__init__``'s Python frame: the same validation and
# the same event, a third less of a token's cost (every sampled token of every sample is one).
_validate_token = TokenEvent.__pydantic_validator__.validate_python


def _token_event(group: str, sample: int, held: tuple[int, int, str], novelty: float | None) -> TokenEvent:
    """The token event of a pending ``held`` (index, token id, text)."""
    index, token_id, text = held
    return _validate_token(
        {"group": group, "sample": sample, "index": index, "token_id": token_id, "text": text, "novelty": novelty}
    )


def find_stop(text: str, new_chars: int, stop: Sequence[str]) -> int:
    """Where in ``text`` the first stop string to complete within its last ``new_chars``
    characters begins, or -1. vLLM's rule: the one that completes earliest, ties in list order."""
    found, end = -1, len(text) + 1
    if not new_chars:
        return found
    for s in stop:
        at = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if at != -1 and at + len(s) < end:
            found, end = at, at + len(s)
    return found


def stop_prefix(text: str, stop: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that a stop string begins with (and is longer
    than): text a later token may still turn into a stop string."""
    for size in range(min(len(text), max(map(len, stop)) - 1), 0, -1):
        tail = text[-size:]
        if any(s.startswith(tail) for s in stop):
            return size
    return 0


class GroupStream:
    """Per-group event bookkeeping shared by all engines.

    A sampled token waits until the step where it is the input: that step's Distiller error is
    its novelty. ``novelties`` delivers those errors; ``sampled`` queues the new tokens; ``finish``
    flushes a sample's last token (novelty unknown) and emits its ``done``.

    With stop strings (``stop``) a token also waits while its text may be the start of one; the
    token whose text completes a stop string ends the sample (finish reason "stop"), and the
    texts of its tokens then end where the stop string begins, as vLLM's text does. A token whose
    text lay wholly inside the stop string keeps its place and id with empty text. A sample that
    ends another way keeps the text it waited with.
    """

    def __init__(
        self,
        group: str,
        n: int,
        tokenizer,
        normalizer: NoveltyNormalizer,
        stop_ids: Iterable[int] = (),
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
    ) -> None:
        self.group, self.n = group, n
        self.normalizer = normalizer
        self.stop_ids = frozenset(stop_ids)
        self.stop = tuple(stop)
        self.detok = [IncrementalDetokenizer(tokenizer, prompt_ids) for _ in range(n)]
        self.pending: dict[int, tuple[int, int, str]] = {}  # sample → (index, token id, text)
        # With stop strings, every token not yet emitted, oldest first, instead of ``pending``:
        # [index, token id, text, novelty, novelty known]; the first ``decided`` have their final text.
        self.queue: list[list] = [[] for _ in range(n)] if self.stop else []
        self.decided = [0] * n
        self.count = [0] * n
        self.finished: dict[int, str] = {}

    def novelties(self, samples: Sequence[int], errors: Sequence[float] | None) -> list[Event]:
        """Release the pending tokens of ``samples`` with the novelty of their raw ``errors``."""
        if errors is None:
            values: list[float | None] = [None] * len(samples)
        else:
            values = self.normalizer.normalise(self.group, errors if type(errors) is list else list(errors))
        events: list[Event] = []
        if self.stop:
            for sample, value in zip(samples, values):
                events += self._settle(sample, value)
            return events
        pending, group = self.pending, self.group
        for sample, value in zip(samples, values):  # ``_release``, inline: every sample of the step
            held = pending.pop(sample, None)
            if held is not None:
                events.append(_token_event(group, sample, held, value))
        return events

    def _release(self, sample: int, novelty: float | None) -> list[Event]:
        held = self.pending.pop(sample, None)
        return [] if held is None else [_token_event(self.group, sample, held, novelty)]

    def _settle(self, sample: int, novelty: float | None) -> list[Event]:
        """With stop strings: the newest token of ``sample`` has its novelty; emit the tokens,
        oldest first, that have both their novelty and their final text."""
        queue = self.queue[sample]
        if queue and not queue[-1][4]:
            queue[-1][3], queue[-1][4] = novelty, True
        events: list[Event] = []
        while self.decided[sample] and queue[0][4]:
            index, token_id, text, value, _ = queue.pop(0)
            self.decided[sample] -= 1
            events.append(_token_event(self.group, sample, (index, token_id, text), value))
        return events

    def sampled(self, sample: int, token_id: int) -> bool:
        """Queue a freshly sampled token. Returns True when the sample stops here: at a stop token
        (not shown) or at a token that completes a stop string (shown up to where it begins)."""
        if token_id in self.stop_ids:
            return True
        text = self.detok[sample].push(token_id)
        index = self.count[sample]
        self.count[sample] += 1
        if not self.stop:
            self.pending[sample] = (index, token_id, text)
            return False
        queue = self.queue[sample]
        queue.append([index, token_id, text, None, False])
        undecided = queue[self.decided[sample] :]
        window = "".join(t[2] for t in undecided)
        cut = find_stop(window, len(text), self.stop)
        if cut >= 0:  # every text ends where the stop string begins
            at = 0
            for t in undecided:
                t[2], at = t[2][: max(0, cut - at)], at + len(t[2])
            self.decided[sample] = len(queue)
            return True
        keep, at = len(window) - stop_prefix(window, self.stop), 0
        for t in undecided:  # a token's text is final once it ends before text that may begin a stop string
            at += len(t[2])
            if at > keep:
                break
            self.decided[sample] += 1
        return False

    def finish(self, sample: int, reason: str) -> list[Event]:
        if sample in self.finished:
            return []
        if self.stop:
            queue, self.queue[sample], self.decided[sample] = self.queue[sample], [], 0
            events: list[Event] = [
                _token_event(self.group, sample, (index, token_id, text), value if known else None)
                for index, token_id, text, value, known in queue
            ]
        else:
            events = self._release(sample, None)
        self.finished[sample] = reason
        events.append(DoneEvent(group=self.group, sample=sample, finish_reason=reason, tokens=self.count[sample]))
        return events

    def finish_all(self, reason: str) -> list[Event]:
        events: list[Event] = []
        for sample in range(self.n):
            events.extend(self.finish(sample, reason))
        self.normalizer.forget(self.group)
        return events

    @property
    def done(self) -> bool:
        return len(self.finished) == self.n


class RateMeter:
    """Tokens per second over a sliding window of recent steps."""

    def __init__(self, window_s: float = 2.0) -> None:
        self.window_s = window_s
        self._marks: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, tokens: int, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        self._marks.append((now, tokens))
        while len(self._marks) > 2 and now - self._marks[0][0] > self.window_s:
            self._marks.popleft()
        if len(self._marks) < 2:
            return 0.0
        span = now - self._marks[0][0]
        produced = sum(t for _, t in itertools.islice(self._marks, 1, None))
        return produced / span if span > 0 else 0.0


# -- the skeleton every engine fills in --------------------------------------------------------


def resolve_layer(index: int, num_layers: int, what: str) -> int:
    """A tap layer index (negative counts from the end) as 0..L-1, or a ``ConfigError``."""
    if not -num_layers <= index < num_layers:
        raise ConfigError(
            f"{what} layer {index} is out of range for a {num_layers}-layer model",
            hint=f"choose a layer between {-num_layers} and {num_layers - 1}",
        )
    return index % num_layers


def stop_token_ids(model_dir: Path | None, tokenizer) -> set[int]:
    """The model's stop tokens: ``generation_config.json``'s eos ids, else the tokenizer's eos."""
    ids: set = set()
    gen = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if gen is not None and gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos])
    if not ids and tokenizer is not None:
        ids.add(tokenizer.eos_token_id)
    return {int(i) for i in ids if i is not None}


@dataclass
class Group:
    """A running prompt group, as every engine tracks it (engines subclass it for their state)."""

    key: str
    sampling: SamplingConfig
    steering: Steering
    stream: GroupStream
    prompt_ids: list[int]
    max_new: int  # tokens each sample may generate (the request's budget within the context)

    @property
    def steered(self) -> bool:
        return self.steering.enabled


@dataclass
class StepStats:
    """What one engine step did, summed over its groups; becomes the step's ``StepEvent``."""

    tokens: int = 0  # tokens sampled
    rows: int = 0  # rows decoded
    port_hits: int = 0  # tapped rows delivered to the Distiller
    losses: dict[str, list[float]] = field(default_factory=dict)  # group → its losses, oldest first
    candidates: list[float] = field(default_factory=list)  # mean |C| per steered group

    def add_loss(self, group: str, loss: float) -> None:
        """One optimizer step of ``group``'s Distiller took ``loss`` (what the eval attributes to
        the group's step index, and the dashboard charts as the step's mean)."""
        self.losses.setdefault(group, []).append(loss)

    def event(self, step: int, rate: RateMeter) -> StepEvent:
        every = [v for values in self.losses.values() for v in values]
        return StepEvent(
            step=step,
            rows=self.rows,
            tokens_per_s=round(rate.add(self.tokens), 3),
            loss=sum(every) / len(every) if every else None,
            losses=self.losses,
            port_hits=self.port_hits,
            candidates=sum(self.candidates) / len(self.candidates) if self.candidates else 0.0,
            esamp=self.port_hits > 0,
        )


class EngineBase:
    """The group lifecycle every engine shares. Subclasses set, in their ``__init__``:
    ``tokenizer`` (None for token-id-only models), ``context``, ``stop_ids``, ``hidden``,
    ``num_layers``, ``model_name``, ``device_name``; and implement ``_admit``, ``step``,
    ``_cancel``, ``_release`` and ``_shutdown``."""

    name = ""

    def __init__(self, esamp: EsampConfig | None) -> None:
        self._t0 = time.perf_counter()
        self.esamp = esamp or EsampConfig()
        self.groups: dict[str, Group] = {}
        self.normalizer = NoveltyNormalizer()
        self.rate = RateMeter()
        self.step_count = 0
        self.tokenizer = None
        self.stop_ids: set[int] = set()
        self._ready: ReadyEvent | None = None

    def _loaded(self) -> None:
        """Call at the end of ``__init__``: the model is loaded and the engine takes work."""
        self._ready = ReadyEvent(
            engine=self.name,
            model=self.model_name,
            device=self.device_name,
            hidden_size=self.hidden,
            num_layers=self.num_layers,
            context=self.context,
            load_seconds=round(time.perf_counter() - self._t0, 3),
        )

    @property
    def ready(self) -> ReadyEvent:
        return self._ready

    @property
    def has_chat_template(self) -> bool:
        """Whether ``start(..., chat=True)`` applies a chat template (``has_chat_template``)."""
        return has_chat_template(self.tokenizer)

    # -- admission ---------------------------------------------------------------------------

    def steering_of(self, steering: Steering | None) -> Steering:
        """A group's steering: a ``Steering``, or the engine's default (None)."""
        if steering is None:
            return self.esamp.steering
        if not isinstance(steering, Steering):
            raise ConfigError(
                f"a group takes a Steering (on/off, beta, mix, training), not a {type(steering).__name__}",
                hint="pass config.steering; the engine-wide settings (taps, rank, slots, ...) are fixed when "
                "the engine starts",
            )
        return steering

    def encode(self, prompt: str | Sequence[int], chat: bool = True) -> list[int]:
        if isinstance(prompt, str) and self.tokenizer is None:
            raise PromptError(
                f"{self.model_name} has no tokenizer (random weights): give the prompt as token ids",
                hint="pass a list of token ids (esamp bench builds them), or use a real model",
            )
        return encode_prompt(self.tokenizer, prompt, chat, self.context)

    def start(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingConfig,
        steering: Steering | None = None,
        group: str | None = None,
        chat: bool = True,
    ) -> str:
        """Admit a group of ``sampling.n`` samples of ``prompt``; returns its key."""
        steering = self.steering_of(steering)
        ids = self.encode(prompt, chat)
        key = group or new_group_key()
        if key in self.groups:
            raise EngineError(f"group {key!r} is already running", hint="use a new group key")
        stream = GroupStream(
            key,
            sampling.n,
            self.tokenizer,
            self.normalizer,
            () if sampling.ignore_eos else self.stop_ids,
            ids,
            stop=sampling.stop,
        )
        g = self._admit(
            Group(
                key=key,
                sampling=sampling,
                steering=steering,
                stream=stream,
                prompt_ids=ids,
                max_new=min(sampling.max_tokens, self.context - len(ids)),
            )
        )
        self.groups[key] = g
        return key

    def _admit(self, group: Group) -> Group:
        """Take the group on (a Distiller slot, requests, ...); may return a subclass instance.
        Raise ``BankFullError`` when no slot is free."""
        raise NotImplementedError

    # -- the end of a group ------------------------------------------------------------------

    def abort(self, group: str) -> list[Event]:
        g = self.groups.pop(group, None)
        if g is None:
            return []
        self._cancel(g)
        self._release(g)
        return g.stream.finish_all("abort")

    def _finished(self, g: Group) -> None:
        """Every sample of ``g`` is done: forget it and give its Distiller slot back."""
        self.groups.pop(g.key, None)
        self._release(g)
        self.normalizer.forget(g.key)

    def _failed(self, g: Group, exc: BaseException) -> list[Event]:
        """One group failed: end it with an error event; the other groups keep running."""
        return [
            ErrorEvent(
                message=f"generation failed: {exc}", group=g.key, hint="the other groups keep running; try again"
            )
        ] + self.abort(g.key)

    def _cancel(self, g: Group) -> None:
        """Stop decoding ``g``'s unfinished samples (nothing to do where the engine owns the loop)."""

    def _release(self, g: Group) -> None:
        """Give ``g``'s Distiller slot back."""
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    def close(self) -> None:
        for key in list(self.groups):
            self.abort(key)
        self._shutdown()

    def _shutdown(self) -> None:
        """Free the engine's resources (hooks, processes)."""

    # -- steps -------------------------------------------------------------------------------

    def step(self) -> list[Event]:
        raise NotImplementedError

    def _advance_groups(self, advance, stats: StepStats) -> list[Event]:
        """``advance(group) -> events`` for every running group, then the step's ``StepEvent``.

        A group that raises ends with an error event and the others keep running; a group whose
        samples are all done is forgotten and gives its slot back.
        """
        return self._each_group(advance) + self._step_event(stats)

    def _each_group(self, work) -> list[Event]:
        """``work(group) -> events`` for every running group: a group that raises ends with an
        error event and the others go on; a group whose samples are all done is forgotten."""
        events: list[Event] = []
        for key in list(self.groups):
            g = self.groups[key]
            try:
                events += work(g)
            except Exception as exc:  # one failing group must not take the others down
                events += self._failed(g, exc)
                continue
            if g.stream.done:
                self._finished(g)
        return events

    def _step_event(self, stats: StepStats) -> list[Event]:
        """The step's ``StepEvent`` (none when the step decoded nothing)."""
        if not (stats.rows or stats.port_hits):
            return []
        event = stats.event(self.step_count, self.rate)
        self.step_count += 1
        return [event]
