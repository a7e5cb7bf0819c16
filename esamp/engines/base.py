"""What every engine shares: the protocol, per-sample streaming bookkeeping, rate metering.

An engine runs prompt groups. ``start`` admits a group of n samples, each ``step`` advances every
running group by one token and returns the events of that step, ``abort`` ends a group early.
Engines emit events only through ``GroupStream``, so the token/novelty/done rules are the same
everywhere (see ``esamp.events``).
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Iterable, Iterator, Protocol, Sequence

from esamp.core.config import EsampConfig, SamplingConfig
from esamp.errors import PromptError
from esamp.events import DoneEvent, Event, ReadyEvent, TokenEvent
from esamp.core.novelty import NoveltyNormalizer

_group_counter = itertools.count()


def new_group_key(prefix: str = "g") -> str:
    return f"{prefix}{next(_group_counter)}-{time.monotonic_ns() % 1_000_000:06d}"


class Engine(Protocol):
    name: str

    @property
    def ready(self) -> ReadyEvent: ...

    def start(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingConfig,
        esamp: EsampConfig | None = None,
        group: str | None = None,
        chat: bool = True,
    ) -> str: ...

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
            raise PromptError(f"the prompt is not valid UTF-8 text: character {i + 1}{raw} cannot be read",
                              hint="retype the prompt, or convert it to UTF-8 (iconv -t UTF-8)")
    visible = "".join(ch for ch in prompt.translate(_INVISIBLE) if ch.isprintable() and not ch.isspace())
    if not visible:
        raise PromptError("the prompt is empty", hint="type a question or an instruction")
    return prompt


def encode_prompt(tokenizer, prompt: str | Sequence[int], chat: bool, context: int) -> list[int]:
    """Prompt → token ids: text through the chat template (when the model has one), or ids as
    given. Empty prompts and prompts that fill the context are errors a user can act on."""
    if not isinstance(prompt, str):
        ids = [int(t) for t in prompt]
    else:
        check_prompt_text(prompt)
        if chat and getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
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


def run(engine: Engine, prompt, sampling: SamplingConfig, esamp: EsampConfig | None = None, **kw) -> Iterator[Event]:
    """Start one group and yield its events until every sample is done."""
    group = engine.start(prompt, sampling, esamp, **kw)
    try:
        while engine.has_unfinished():
            yield from engine.step()
    except BaseException:
        engine.abort(group)
        raise


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding the whole list."""

    def __init__(self, tokenizer, prompt_tail: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_tail)[-4:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""


class GroupStream:
    """Per-group event bookkeeping shared by all engines.

    A sampled token waits until the step where it is the input: that step's Distiller error is
    its novelty. ``novelties`` delivers those errors; ``sampled`` queues the new tokens; ``finish``
    flushes a sample's last token (novelty unknown) and emits its ``done``.
    """

    def __init__(self, group: str, n: int, tokenizer, normalizer: NoveltyNormalizer,
                 stop_ids: Iterable[int] = (), prompt_ids: Sequence[int] = ()) -> None:
        self.group, self.n = group, n
        self.normalizer = normalizer
        self.stop_ids = frozenset(stop_ids)
        self.detok = [IncrementalDetokenizer(tokenizer, prompt_ids) for _ in range(n)]
        self.pending: dict[int, tuple[int, int, str]] = {}  # sample → (index, token id, text)
        self.count = [0] * n
        self.finished: dict[int, str] = {}

    def novelties(self, samples: Sequence[int], errors: Sequence[float] | None) -> list[Event]:
        """Release the pending tokens of ``samples`` with the novelty of their raw ``errors``."""
        if errors is None:
            values: list[float | None] = [None] * len(samples)
        else:
            values = list(self.normalizer.normalise(self.group, list(errors)))
        events: list[Event] = []
        for sample, value in zip(samples, values):
            events.extend(self._release(sample, value))
        return events

    def _release(self, sample: int, novelty: float | None) -> list[Event]:
        pending = self.pending.pop(sample, None)
        if pending is None:
            return []
        index, token_id, text = pending
        return [TokenEvent(group=self.group, sample=sample, index=index, token_id=token_id,
                           text=text, novelty=novelty)]

    def sampled(self, sample: int, token_id: int) -> bool:
        """Queue a freshly sampled token. Returns True when it is a stop token (not shown)."""
        if token_id in self.stop_ids:
            return True
        text = self.detok[sample].push(token_id)
        self.pending[sample] = (self.count[sample], token_id, text)
        self.count[sample] += 1
        return False

    def finish(self, sample: int, reason: str) -> list[Event]:
        if sample in self.finished:
            return []
        events = self._release(sample, None)
        self.finished[sample] = reason
        events.append(DoneEvent(group=self.group, sample=sample, finish_reason=reason,
                                tokens=self.count[sample]))
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
