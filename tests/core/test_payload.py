"""The flat per-request payload: one form for vllm_xargs and extra_args, errors that name the key."""

from __future__ import annotations

import pytest

from esamp.core import payload as pl
from esamp.core.config import Filters, Steering
from esamp.errors import ConfigError


def test_round_trip():
    extra = pl.encode(
        Steering(beta=1.2, mix="unsharpened", train=False),
        group="g",
        sample=3,
        filters=Filters(top_k=7),
        seed=4,
        n=8,
        records=True,
    )
    assert extra["esamp"] == "on" and extra["esamp_train"] == "off" and extra["esamp_beta"] == 1.2
    assert all(isinstance(v, (str, int, float)) for v in extra.values())  # flat, as vllm_xargs must be
    got = pl.decode(extra)
    assert got.steering_over(Steering()) == Steering(beta=1.2, mix="unsharpened", train=False)
    assert (got.group, got.sample, got.seed, got.n, got.records) == ("g", 3, 4, 8, True)
    assert got.filters == Filters(top_k=7)


def test_a_typed_payload_is_written_flat_as_decode_reads_it():
    """``Payload.flat`` is the one writer of the flat form: ``decode`` gives the payload back, and
    ``encode`` is a payload with every steering field."""
    typed = pl.Payload(
        steering={"beta": 1.2, "train": False}, filters=Filters(top_k=7), group="g", sample=3, seed=4, n=8, records=True
    )
    flat = typed.flat()
    assert flat["esamp_train"] == "off" and flat["esamp_records"] == "on"
    assert pl.decode(flat) == typed
    steering = Steering(beta=0.5)
    assert pl.encode(steering, group="g") == pl.Payload(steering=steering.model_dump(), group="g").flat()


def test_requests_without_esamp_keys_are_not_esamp_requests():
    assert pl.decode(None) is None and pl.decode({}) is None and pl.decode({"other": 1}) is None


def test_what_a_request_leaves_out_comes_from_the_engine():
    got = pl.decode({"esamp_beta": "0.4"})
    assert got.steering == {"beta": 0.4}
    assert got.steering_over(Steering(mix="unsharpened", beta=2.0)) == Steering(mix="unsharpened", beta=0.4)
    assert pl.decode({"esamp": "off"}).enabled is False


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"esamp_beta": 11}, ["esamp_beta=11", "<= 10"]),
        ({"esamp_mix": "sharp"}, ["esamp_mix='sharp'", "paper", "unsharpened"]),
        ({"esamp": "maybe"}, ["esamp='maybe'"]),
        ({"esamp_bta": 1}, ["unknown ESamp setting esamp_bta", "esamp_beta"]),
        ({"esamp_sample": -1}, ["esamp_sample"]),
        ({"esamp_top_p": 0}, ["esamp_top_p=0", "> 0"]),
    ],
)
def test_bad_values_name_the_key_and_the_range(extra, words):
    with pytest.raises(ConfigError) as err:
        pl.decode(extra)
    text = err.value.user_text()
    for word in words:
        assert word in text, text
    assert "hint:" in text
