"""Stop strings: a sample ends at the token whose text completes one, its text ends where the stop
string begins, and its token events stay in order (``GroupStream``, shared by every engine)."""

from __future__ import annotations

import pytest

from esamp.core.config import SamplingConfig, Steering
from esamp.core.novelty import NoveltyNormalizer
from esamp.engines.base import GroupStream, find_stop, run, stop_prefix

VOCAB = ["The", " answer", " is", " 12", ".\n", "\nQ", "uestion", "\n", "x", ""]


class WordTokenizer:
    """Token i is ``VOCAB[i]``."""

    def text_decoder(self):
        return lambda ids: "".join(VOCAB[i] for i in ids)


def stream(ids, stop, errors=True):
    """Feed ``ids`` to one sample as the engines do (each step: the inputs' novelty, then the new
    token); the events and whether the last token stopped the sample."""
    s = GroupStream("g", 1, WordTokenizer(), NoveltyNormalizer(), stop=stop)
    events = []
    for step, token in enumerate(ids):
        if step:
            events += s.novelties([0], [0.5 + step] if errors else None)
        if s.sampled(0, token):
            return events + s.finish(0, "stop")
    return events + s.finish(0, "length")


def tokens(events):
    return [(e.index, e.token_id, e.text) for e in events if e.type == "token"]


def test_a_stop_string_over_two_tokens_ends_the_sample_and_its_text():
    events = stream([0, 1, 2, 3, 4, 5, 6], stop=["\n\n"])
    assert tokens(events) == [(0, 0, "The"), (1, 1, " answer"), (2, 2, " is"), (3, 3, " 12"), (4, 4, "."), (5, 5, "")]
    done = events[-1]
    assert done.type == "done" and done.finish_reason == "stop" and done.tokens == 6
    novelty = [e.novelty for e in events if e.type == "token"]
    assert all(v is not None for v in novelty[:-1]) and novelty[-1] is None  # the last was never an input


def test_text_that_may_begin_a_stop_string_waits_and_is_kept_when_it_does_not():
    events = stream([0, 7, 8, 7], stop=["\nQuestion:"])  # "The\nx\n": a newline, then not the stop
    assert "".join(t for *_, t in tokens(events)) == "The\nx\n"
    assert [i for i, *_ in tokens(events)] == [0, 1, 2, 3]
    assert events[-1].finish_reason == "length"
    # "\nQ" + "uestion" + ":"? no ":" in the vocabulary: the held text comes out when the sample ends
    assert "".join(t for *_, t in tokens(stream([0, 5, 6], stop=["\nQuestion:"]))) == "The\nQuestion"


def test_the_stop_string_may_begin_inside_a_token_that_came_earlier():
    events = stream([0, 1, 5, 6], stop=["\nQuestion"])
    assert tokens(events) == [(0, 0, "The"), (1, 1, " answer"), (2, 5, ""), (3, 6, "")]
    assert events[-1].finish_reason == "stop" and events[-1].tokens == 4


def test_without_stop_strings_nothing_changes():
    assert tokens(stream([0, 4, 5], stop=[])) == [(0, 0, "The"), (1, 4, ".\n"), (2, 5, "\nQ")]


def test_find_stop_takes_the_string_that_completes_first_as_vllm_does():
    assert find_stop("ab\n\nQ", 3, ["\nQ", "\n\n"]) == 2  # "\n\n" completes first
    assert find_stop("abc", 1, ["ab"]) == -1  # completed before the new text: already checked
    assert find_stop("abc", 0, ["c"]) == -1
    assert stop_prefix("The\n", ["\nQuestion:"]) == 1 and stop_prefix("The\nQu", ["\nQuestion:"]) == 3
    assert stop_prefix("The", ["\nQuestion:"]) == 0


@pytest.mark.slow
def test_the_reference_engine_stops_where_the_text_first_holds_the_stop_string(reference_engine):
    """One sample, ESamp off: with a stop string the same tokens come, up to the one that
    completes it, and the text ends where it begins."""

    def sample(**kw):
        s = SamplingConfig(n=1, max_tokens=24, seed=4, **kw)
        events = list(run(reference_engine, "Name three colours.", s, Steering(enabled=False)))
        toks = [e for e in events if e.type == "token"]
        (done,) = [e for e in events if e.type == "done"]
        return [t.token_id for t in toks], "".join(t.text for t in toks), done

    ids, full, _ = sample()
    stop = full[len(full) // 3 : len(full) // 3 + 3]
    cut = full.find(stop)
    got_ids, text, done = sample(stop=[stop])
    assert text == full[:cut] and stop not in text
    assert got_ids == ids[: len(got_ids)] and len(got_ids) < len(ids)
    assert done.finish_reason == "stop" and done.tokens == len(got_ids)
