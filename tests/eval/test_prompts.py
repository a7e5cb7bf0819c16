"""How problems reach the model: the chat template where the model has one, else a completion
frame with stop strings (a pretrained base model would write on to --max-tokens)."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest

import esamp.engines
from esamp.commands.cli import main
from esamp.engines.base import EngineBase
from esamp.eval.prompts import BARE, CHAT, COMPLETION, frame_for, legacy_frame
from esamp.eval.runner import (
    EvalSettings,
    ResumeMismatch,
    append_record,
    prepare_out_dir,
    record_prompts,
    run_groups,
)
from esamp.eval.tasks import Problem

from .fake_engine import FakeEngine

PROBLEMS = [Problem(id=f"q{i}", prompt=f"What is {i} + 1?", answer=str(i + 1), kind="math") for i in range(2)]


class BaseModelEngine(FakeEngine):
    """The fake engine of a model without a chat template; keeps what every group was started with."""

    has_chat_template = False

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.asked: list[tuple] = []

    def start(self, prompt, sampling, esamp=None, group=None, chat=True) -> str:
        self.asked.append((prompt, sampling, chat))
        return super().start(prompt, sampling, esamp, group, chat)


class ChatEngine(BaseModelEngine):
    has_chat_template = True


def _engine_with(tokenizer) -> EngineBase:
    engine = EngineBase(None)
    engine.tokenizer = tokenizer
    return engine


def test_the_frame_follows_the_tokenizers_chat_template():
    chat = _engine_with(SimpleNamespace(chat_template="{{ messages }}"))
    base = _engine_with(SimpleNamespace(chat_template=None))
    assert chat.has_chat_template and not base.has_chat_template
    assert frame_for(chat) is CHAT and legacy_frame(chat) is CHAT
    assert frame_for(base) is COMPLETION and legacy_frame(base) is BARE
    assert frame_for(_engine_with(SimpleNamespace())) is COMPLETION  # a tokenizer without the attribute


def _run(tmp_path, engine, frame):
    settings = EvalSettings(task="t", problem_ids=[p.id for p in PROBLEMS], n=2, engine="fake")
    prepare_out_dir(tmp_path, settings)
    run_groups(PROBLEMS, engine, settings, tmp_path, lambda p, texts: None, lambda texts: None, frame=frame)
    return settings


def test_a_model_without_a_chat_template_gets_the_completion_frame_and_its_stop_strings(tmp_path):
    engine = BaseModelEngine()
    settings = _run(tmp_path, engine, frame_for(engine))
    for (prompt, sampling, chat), problem in zip(engine.asked, PROBLEMS * 2):
        assert prompt == f"Question: {problem.prompt}\nAnswer:" and chat is False
        assert sampling.stop == ["\n\n", "\nQuestion:"]
        assert sampling.model_copy(update={"stop": []}) == settings.sampling(problem.id)  # the same seed


def test_a_model_with_a_chat_template_gets_the_problem_as_before(tmp_path):
    engine = ChatEngine()
    settings = _run(tmp_path, engine, frame_for(engine))
    assert [(prompt, chat) for prompt, _, chat in engine.asked] == [(p.prompt, True) for p in PROBLEMS] * 2
    baseline = [s for (_, s, _), arm in zip(engine.asked, ["baseline"] * 2 + ["esamp"] * 2)]
    assert baseline == [settings.sampling(p.id, "baseline") for p in PROBLEMS] * 2  # no stop, same seeds


def test_a_folder_keeps_its_frame_and_refuses_another(tmp_path):
    settings = EvalSettings(task="t", problem_ids=["q0"], n=2, engine="fake")
    prepare_out_dir(tmp_path, settings)
    record_prompts(tmp_path, COMPLETION, BARE)
    record_prompts(tmp_path, COMPLETION, BARE)  # the same frame resumes
    assert json.loads((tmp_path / "run.json").read_text())["settings"]["prompts"] == COMPLETION.record()
    prepare_out_dir(tmp_path, settings)  # a resumed run keeps the recorded frame
    with pytest.raises(ResumeMismatch, match="there: completion frame .*; now: the model's chat template"):
        record_prompts(tmp_path, CHAT, CHAT)


def test_replies_sampled_before_frames_were_recorded_count_as_the_bare_problem(tmp_path):
    settings = EvalSettings(task="t", problem_ids=["q0"], n=2, engine="fake")
    for folder, frame, legacy, refused in (
        ("chat", CHAT, CHAT, False),
        ("base", COMPLETION, BARE, True),
    ):
        out = tmp_path / folder
        prepare_out_dir(out, settings)
        append_record(out, {"problem": "q0", "arm": "baseline", "texts": ["x", "y"]})
        if refused:
            with pytest.raises(ResumeMismatch, match="each problem as it is"):
                record_prompts(out, frame, legacy)
        else:
            record_prompts(out, frame, legacy)


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="needs math-verify (the eval extra)")
def test_the_report_says_which_frame_the_run_used(tmp_path, monkeypatch, capsys):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "prompt": p.prompt, "answer": p.answer}) + "\n" for p in PROBLEMS))
    monkeypatch.setattr(esamp.engines, "create_engine", lambda name, model=None, **kw: BaseModelEngine())
    out = tmp_path / "out"
    argv = ["eval", "--task-file", str(path), "-n", "2", "--no-diversity", "--engine", "reference", "--out", str(out)]
    assert main([*argv, "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["prompts"] == COMPLETION.record()
    md = (out / "report.md").read_text()
    assert (
        '- prompts: completion frame (the model has no chat template): "Question: {prompt}\\nAnswer:", '
        'stop at "\\n\\n", "\\nQuestion:"' in md
    )
    monkeypatch.setattr(esamp.engines, "create_engine", lambda name, model=None, **kw: ChatEngine())
    more = [*argv, "--matrix", "beta=0.4", "--quiet"]  # a new cell on a model with a chat template: refused
    assert main(more) == 2
    assert "framed otherwise" in capsys.readouterr().err
