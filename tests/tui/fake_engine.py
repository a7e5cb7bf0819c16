"""A scripted engine with the real protocol: deterministic events, no model, no torch.

Runs inside the session's spawned worker (``SessionSpec(engine_factory=FACTORY)``), so the
dashboard's tests exercise the real process, queues and reader thread.

Script:
- each sample of a group emits ``max_tokens`` tokens, except sample 1 which stops two early
  (``finish_reason="stop"``) so headers show both reasons;
- token text is ``"on{i} "`` when ESamp steers the group (``"un{i} "`` with the unsharpened mix)
  and ``"off{i} "`` when not, with a newline every 8 tokens; novelty cycles through 0.0, 0.25,
  ... 1.0 when on, None when off;
- prompt ``"crash"``: the process dies (``os._exit(9)``) on the third step, like a segfault;
- prompt ``"fail"``: ``step()`` raises on the third step (a Python error inside the engine);
- prompt ``"hold"``: after six steps the group stops advancing (steps emit nothing) until it is
  aborted, a frozen mid-stream state for snapshots;
- prompt ``"words"``: the tokens are pieces of words as a real tokenizer cuts them
  (``WORD_PIECES``: ``" halak"`` + ``"ic"``, a ``"."`` after a word), for the word-wrap tests;
- prompt ``"bad start"``: ``start()`` raises a ``TypeError``, as a tokenizer does on bytes it
  cannot read;
- model ``"missing"``: construction raises ``ModelNotFoundError``;
- ``load_seconds``: construction spins the CPU that long first, like a cold model load;
- ``named_lock``: construction creates a ``multiprocessing.RLock``, a named semaphore, as tqdm
  does for the progress bar of the first start's model conversion;
- ``download_seconds``: construction first reports a download of 2 GB through ``progress``
  (``LoadingEvent``s), as a hub model's first start does, then holds at 1.5 GB until the time is up.
"""

from __future__ import annotations

import os
import time

from esamp.errors import ModelNotFoundError, PromptError
from esamp.events import DoneEvent, LoadingEvent, ReadyEvent, StepEvent, TokenEvent

FACTORY = f"{__name__}:FakeEngine"  # the name this module was imported under; the child shares sys.path
NOVELTY_CYCLE = (0.0, 0.25, 0.5, 0.75, 1.0)
NAMED_LOCKS: list = []
WORD_PIECES = (
    " The",
    " rule",
    " is",
    " halak",
    "ic",
    " and",
    " old",
    ".",
    " Its",
    " source",
    "s",
    " dis",
    "agree",
    " about",
    " it",
    ",",
    " and",
    " so",
    " the",
    " dis",
    "cuss",
    "ion",
    " goes",
    " on",
    ".",
)


def token_text(esamp_on: bool, index: int, mix: str = "paper") -> str:
    word = f"{('on' if mix == 'paper' else 'un') if esamp_on else 'off'}{index}"
    return word + ("\n" if index % 8 == 7 else " ")


class FakeEngine:
    name = "fake"

    def __init__(
        self,
        model=None,
        esamp=None,
        delay: float = 0.0,
        load_seconds: float = 0.0,
        named_lock: bool = False,
        download_seconds: float = 0.0,
        progress=None,
    ):
        if download_seconds and progress is not None:
            progress(LoadingEvent(stage="download", text=f"downloading {model}"))
            for done in (0.5e9, 1.0e9, 1.5e9):
                progress(LoadingEvent(stage="download", text="downloading bytes", done=done, total=2e9, unit="B"))
            time.sleep(download_seconds)
        if named_lock and not NAMED_LOCKS:
            from multiprocessing import RLock

            NAMED_LOCKS.append(RLock())  # kept for the process's life, as tqdm keeps its lock on a class
        end = time.monotonic() + load_seconds
        while time.monotonic() < end:  # busy, as a model load is: only a signal can stop it
            pass
        if model == "missing":
            raise ModelNotFoundError(
                "no model named 'missing' on this machine (looked in ./missing and the HF cache)",
                hint="pass --model PATH to an HF directory or a .gguf file",
            )
        self.delay = delay
        self.groups: dict[str, dict] = {}
        self.step_count = 0
        self._ready = ReadyEvent(
            engine="fake",
            model=model or "scripted",
            device="cpu",
            hidden_size=64,
            num_layers=2,
            context=512,
            load_seconds=0.0,
        )

    @property
    def ready(self):
        return self._ready

    def start(self, prompt, sampling, esamp=None, group=None, chat=True):
        if not str(prompt).strip():
            raise PromptError("the prompt is empty", hint="type a question or an instruction")
        if prompt == "bad start":
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")
        key = group or f"g{len(self.groups)}"
        lengths = [max(1, sampling.max_tokens - (2 if s == 1 else 0)) for s in range(sampling.n)]
        self.groups[key] = dict(
            prompt=str(prompt),
            on=bool(esamp and esamp.enabled),
            mix=esamp.mix if esamp else "paper",
            lengths=lengths,
            count=[0] * sampling.n,
            done=set(),
            steps=0,
        )
        return key

    def has_unfinished(self):
        return bool(self.groups)

    def step(self):
        if self.delay:
            time.sleep(self.delay)
        events, rows, steered = [], 0, False
        for key in list(self.groups):
            g = self.groups[key]
            if g["prompt"] == "hold" and g["steps"] >= 6:
                time.sleep(0.01)
                continue
            g["steps"] += 1
            if g["steps"] == 3 and g["prompt"] == "crash":
                os._exit(9)
            if g["steps"] == 3 and g["prompt"] == "fail":
                raise RuntimeError("scripted failure inside step()")
            steered |= g["on"]
            for sample, length in enumerate(g["lengths"]):
                if sample in g["done"]:
                    continue
                i = g["count"][sample]
                rows += 1
                novelty = NOVELTY_CYCLE[(i + sample) % len(NOVELTY_CYCLE)] if g["on"] else None
                text = WORD_PIECES[i % len(WORD_PIECES)] if g["prompt"] == "words" else token_text(g["on"], i, g["mix"])
                events.append(
                    TokenEvent(group=key, sample=sample, index=i, token_id=1000 + i, text=text, novelty=novelty)
                )
                g["count"][sample] = i + 1
                if i + 1 >= length:
                    g["done"].add(sample)
                    events.append(
                        DoneEvent(
                            group=key, sample=sample, finish_reason="stop" if sample == 1 else "length", tokens=i + 1
                        )
                    )
            if len(g["done"]) == len(g["lengths"]):
                del self.groups[key]
        if not rows:
            return events
        events.append(
            StepEvent(
                step=self.step_count,
                time=1_000_000.0 + self.step_count,
                rows=rows,
                tokens_per_s=50.0 + 10 * (self.step_count % 5),
                loss=1.0 / (1 + self.step_count) if steered else None,
                port_hits=rows if steered else 0,
                candidates=3.0 if steered else 0.0,
                esamp=steered,
            )
        )
        self.step_count += 1
        return events

    def abort(self, group):
        g = self.groups.pop(group, None)
        if g is None:
            return []
        return [
            DoneEvent(group=group, sample=s, finish_reason="abort", tokens=g["count"][s])
            for s in range(len(g["lengths"]))
            if s not in g["done"]
        ]

    def close(self):
        self.groups.clear()
