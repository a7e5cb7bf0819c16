"""How a problem's prompt reaches the model: through its chat template, or in a completion frame.

An instruction-tuned model gets each problem as the user turn of its chat template, and ends its
reply with its end-of-turn token. A pretrained base model has no chat template and no end of a
turn: given the bare problem it writes on ("What is 7 + 5? ... 1. What is 7 + 5? 2. ..."), and
every sample runs to --max-tokens. Such a model gets the problem in a completion frame that
says where an answer goes, with stop strings where the answer ends (``COMPLETION``), as
evaluation harnesses prompt base models. Which frame a run used is part of its settings
(``run.json``'s ``prompts``) and of its report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from esamp.core.config import SamplingConfig


@dataclass(frozen=True)
class PromptFrame:
    """``kind``: "chat" (the model's chat template), "completion" (``text`` with the problem in
    place of ``{prompt}``, no chat template) or "bare" (the problem as it is: what esamp sent a
    model without a chat template before it had frames). ``stop``: stop strings every sample
    of the run gets besides its own."""

    kind: str
    text: str = "{prompt}"
    stop: tuple[str, ...] = ()

    @property
    def chat(self) -> bool:
        return self.kind == "chat"

    def prompt(self, problem: str) -> str:
        """The prompt of one problem (a chat frame's is the problem: the template wraps it)."""
        return problem if self.chat else self.text.replace("{prompt}", problem)

    def sampling(self, sampling: SamplingConfig) -> SamplingConfig:
        """``sampling`` with the frame's stop strings after its own (unchanged without any)."""
        extra = [s for s in self.stop if s not in sampling.stop]
        return sampling.model_copy(update={"stop": [*sampling.stop, *extra]}) if extra else sampling

    def record(self) -> dict:
        """As ``run.json`` and ``report.json`` keep it."""
        return {"kind": self.kind, "text": None if self.chat else self.text, "stop": list(self.stop)}

    def describe(self) -> str:
        """One line for the report."""
        if self.chat:
            return "the model's chat template, each problem as the user turn"
        if self.kind == "bare":
            return "each problem as it is (the model has no chat template)"
        stops = ", ".join(map(_quoted, self.stop))
        return f"completion frame (the model has no chat template): {_quoted(self.text)}, stop at {stops}"


def _quoted(text: str) -> str:
    """Text in quotes on one line, a newline as ``\\n``."""
    return json.dumps(text, ensure_ascii=False)


CHAT = PromptFrame("chat")
COMPLETION = PromptFrame("completion", "Question: {prompt}\nAnswer:", ("\n\n", "\nQuestion:"))
BARE = PromptFrame("bare")


def frame_for(engine) -> PromptFrame:
    """The frame of a run on ``engine``: its chat template where its model has one."""
    return CHAT if engine.has_chat_template else COMPLETION


def legacy_frame(engine) -> PromptFrame:
    """What esamp sent ``engine``'s model before it recorded a run's frame: the chat template
    where the model has one, else the bare problem."""
    return CHAT if engine.has_chat_template else BARE


def describe_record(record: dict) -> str:
    """``PromptFrame.describe`` of a recorded frame."""
    return PromptFrame(record["kind"], record.get("text") or "{prompt}", tuple(record.get("stop", ()))).describe()
