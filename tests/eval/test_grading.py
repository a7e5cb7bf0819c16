import importlib.util
import json
import sys
from pathlib import Path

import pytest

from esamp.eval.grading import MathChecker, extract_answer, extract_code, last_boxed

needs_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None, reason="needs math-verify (the eval extra)"
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the total is \\boxed{42}.", "42"),
        ("first \\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
        ("The final answer is 14.", "14"),
        ("The answer is: 1,200 dollars.", "1200"),
        ("The answer is $x^2 + 1$.", "x^2 + 1"),
        ("Tom has 3 + 4 = 7 apples now.", "7"),
        ("It costs 2.50 dollars.", "2.50"),
        ("Answer: -3", "-3"),
        ("no digits here", None),
        ("cut off \\boxed{12", "12"),  # unbalanced box: fall back to the last number
        ("The answer is 3 + 12 = 15 apples.", "15"),  # right side of an equation
        ("The answer is 24 - 3 = 19 slices.", "19"),
        ("The answer is 208, which is 6 times 8.", "208"),  # first clause only
        ("The answer is the quotient, which is 16.", "16"),
        ("The answer is 121, so the final answer is 121.", "121"),  # the last statement
        ("The answer is 3 + 4.", "4"),  # an unevaluated sum is no answer: last number
        ("The answer is \\frac{1}{2}.", "\\frac{1}{2}"),
        ("The answer is 2.5 hours.", "2.5"),
        ("Tom has 5 apples.\n#### 5", "5"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_last_boxed_nested_braces():
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("nothing") is None


def test_extract_code():
    reply = "Here you go:\n```python\ndef f(x):\n    return x\n```\nDone."
    assert extract_code(reply) == "def f(x):\n    return x\n"
    assert extract_code("def g():\n    pass") == "def g():\n    pass"
    assert extract_code("```python\ndef h():\n    return 1\n") == "def h():\n    return 1\n"  # unclosed


@needs_math_verify
def test_math_checker_right_and_wrong():
    with MathChecker() as m:
        assert m.check("12", "7 + 5 = 12.").correct
        assert m.check("\\frac{1}{2}", "so \\boxed{0.5}").correct
        assert m.check("2\\sqrt{2}", "\\boxed{\\sqrt{8}}").correct
        assert m.check("204", "The answer is 204 minutes.").correct
        wrong = m.check("7", "I think it is 8.")
        assert not wrong.correct and wrong.extracted == "8"
        none = m.check("7", "I do not know.")
        assert not none.correct and none.note == "no answer"
        junk = m.check("7", "\\boxed{\\frac{}{}}")  # unparsable: wrong, and the checker survives
        assert not junk.correct
        assert m.check("3", "\\boxed{3}").correct


def test_math_checker_kills_a_stuck_check():
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    with MathChecker(timeout=0.5, worker=hang) as m:
        m._spawn()  # already started, so the first-call grace period does not apply
        verdict = m.check("1", "\\boxed{1}")
    assert not verdict.correct and verdict.note == "timeout"


# -- replies a person grades differently from "the last number" --------------------------------

FIXTURE = Path(__file__).parent / "fixtures" / "math_replies.jsonl"
REPLIES = [json.loads(line) for line in FIXTURE.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("case", REPLIES, ids=[f"{c['gold']}-{c['note'][:30]}" for c in REPLIES])
def test_labelled_replies_are_read_as_a_person_reads_them(case):
    """Real replies of the embedded model on `arith`, each labelled with the answer a person
    reads in it: a result followed by a restatement of the question counts as the result; a
    remainder or a later wrong statement still counts against the reply."""
    assert extract_answer(case["reply"], case["question"]) == case["answer"]


def test_the_fixture_holds_both_kinds():
    assert sum(c["correct"] for c in REPLIES) >= 5 and sum(not c["correct"] for c in REPLIES) >= 5


@pytest.mark.parametrize(
    "text, question, expected",
    [
        ("9 * 9 = 81\n\nThis answers 9 times 9.", None, "9"),  # no question: the last number, as before
        ("6 * 5 = 30. So there are 30 eggs in 5 boxes.", "6 boxes of 5 eggs: how many eggs?", "30"),
        ("3 * 4 = 12. She pays with 20 and gets 8 back.", "4 notebooks at 3 dollars, paid with 20", "8"),
        ("9 * 1 = 9.", "What is 9 times 1?", "9"),  # the answer may itself be a number of the question
        ("11 times 11 is equivalent to 121 in base-10.", "What is 11 times 11?", "10"),  # no minus sign
        ("It is 20-dollar bills.", None, "20"),
    ],
)
def test_final_number(text, question, expected):
    assert extract_answer(text, question) == expected


@needs_math_verify
def test_labelled_replies_through_the_checker():
    with MathChecker() as m:
        for case in REPLIES:
            verdict = m.check(case["gold"], case["reply"], case["question"])
            assert verdict.correct == case["correct"], case
