"""A tiny deterministic engine with the real protocol, for fast runner tests.

Each sample's reply is "The answer is X ." with X drawn from the group's seed, the sample index
and the group's steering (off, or on with its beta and mix), emitted one word per step. Hotter
sampling draws X from more values (``choices`` at T 0.8, fewer when colder, wrong ones beyond
them when hotter), so a temperature sweep trades accuracy for diversity as a real model does.
``interrupt_at_step`` raises KeyboardInterrupt inside ``step`` to imitate Ctrl-C in the middle of a run.

A steered group's tokens carry a novelty (0.3 + 0.1 · sample) and every step ends with a step
event whose ``losses`` give each steered group the loss 1 / (its step + 1), as a Distiller that
learns would; ESamp off gives neither, as the real engines do.
"""

from __future__ import annotations

import random

from esamp.events import DoneEvent, ReadyEvent, StepEvent, TokenEvent

HOTTER = ("7", "9", "11", "13", "17", "19", "23", "29")  # answers only hotter sampling reaches


class FakeEngine:
    name = "fake"
    has_chat_template = True

    def __init__(self, choices=("1", "2", "3"), interrupt_at_step: int | None = None, esamp=None) -> None:
        self.choices = choices
        self.esamp = esamp  # the engine-wide settings it was created with
        self.steerings: list = []  # the ESamp settings of every group started
        self.most_at_once = 0  # the most groups running at one time
        self.interrupt_at_step = interrupt_at_step
        self.steps = 0
        self.groups: dict[str, dict] = {}
        self.started: list[str] = []
        self.closed = False

    @property
    def ready(self) -> ReadyEvent:
        return ReadyEvent(engine="fake", model="fake-model", device="cpu")

    def start(self, prompt, sampling, esamp=None, group=None, chat=True) -> str:
        key = group or f"g{len(self.started)}"
        assert key not in self.groups
        steered = bool(esamp and esamp.enabled)
        self.steerings.append(esamp)
        style = f"{esamp.beta}-{esamp.mix}" if steered else "off"
        spread = max(1, round(len(self.choices) * sampling.temperature / 0.8))
        pool = (tuple(self.choices) + HOTTER)[:spread]
        words = []
        for sample in range(sampling.n):
            rng = random.Random(f"{sampling.seed}-{style}-{sample}")
            filler = rng.choice(["Well,", "So", "Hmm,", "Then"])
            words.append([filler, "the", "answer", "is", rng.choice(pool), "."])
        self.groups[key] = {"words": words, "pos": [0] * sampling.n, "steered": steered, "steps": 0}
        self.started.append(key)
        self.most_at_once = max(self.most_at_once, len(self.groups))
        return key

    def step(self):
        self.steps += 1
        if self.interrupt_at_step is not None and self.steps >= self.interrupt_at_step:
            raise KeyboardInterrupt
        events = []
        losses = {}
        for key in list(self.groups):
            g = self.groups[key]
            if g["steered"]:
                losses[key] = [1.0 / (g["steps"] + 1)]
            g["steps"] += 1
            for sample, words in enumerate(g["words"]):
                pos = g["pos"][sample]
                if pos < len(words):
                    events.append(
                        TokenEvent(
                            group=key,
                            sample=sample,
                            index=pos,
                            token_id=pos,
                            text=(" " if pos else "") + words[pos],
                            novelty=round(0.3 + 0.1 * sample, 4) if g["steered"] else None,
                        )
                    )
                    g["pos"][sample] += 1
                    if g["pos"][sample] == len(words):
                        events.append(DoneEvent(group=key, sample=sample, finish_reason="stop", tokens=len(words)))
            if all(p == len(w) for p, w in zip(g["pos"], g["words"])):
                del self.groups[key]
        every = [v for values in losses.values() for v in values]
        events.append(
            StepEvent(
                step=self.steps - 1,
                rows=1,
                tokens_per_s=0.0,
                esamp=bool(losses),
                loss=sum(every) / len(every) if every else None,
                losses=losses,
            )
        )
        return events

    def abort(self, group):
        self.groups.pop(group, None)
        return []

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    def close(self) -> None:
        self.closed = True
