import pytest

from esamp.core.config import EsampConfig, SamplingConfig, make_config, update_config
from esamp.errors import ConfigError


def test_defaults_match_the_published_matrix():
    e, s = EsampConfig(), SamplingConfig()
    assert (e.steering.beta, e.steering.mix, e.rank, e.lr) == (0.8, "paper", 64, 1e-3)
    assert (s.temperature, s.top_p, s.min_p) == (0.8, 0.95, 0.1)


@pytest.mark.parametrize(
    "model, field, value, words",
    [
        (EsampConfig, "beta", 11.0, ["beta=11.0", "<= 10"]),
        (EsampConfig, "beta", -0.1, ["beta=-0.1", ">= 0"]),
        (EsampConfig, "rank", 0, ["rank=0", ">= 1"]),
        (EsampConfig, "mix", "sharp", ["mix='sharp'", "paper"]),
        (SamplingConfig, "n", 0, ["n=0", ">= 1 and <= 64"]),
        (SamplingConfig, "n", 65, ["n=65"]),
        (SamplingConfig, "top_p", 0.0, ["top_p=0.0", "> 0.0"]),
        (SamplingConfig, "min_p", 1.0, ["min_p=1.0", "< 1.0"]),
        (SamplingConfig, "stop", ["\n", ""], ["stop.1=''", "a stop string cannot be empty", "e.g. a newline"]),
        (SamplingConfig, "stop", 3, ["stop=3", "a valid list"]),
        (SamplingConfig, "stop", [None], ["stop.0=None", "a valid string"]),
    ],
)
def test_errors_name_the_field_and_range(model, field, value, words):
    with pytest.raises(ConfigError) as info:
        make_config(model, **{field: value})
    text = info.value.user_text()
    for word in words:
        assert word in text
    assert "hint:" in text


def test_stop_strings_default_to_none_and_one_string_is_a_list_of_one():
    assert SamplingConfig().stop == [] and SamplingConfig.model_fields["stop"].default_factory is list
    assert SamplingConfig(stop="\n\n").stop == ["\n\n"]
    assert SamplingConfig(stop=["\n\n", "\nQuestion:"]).model_dump()["stop"] == ["\n\n", "\nQuestion:"]


def test_unknown_field_is_rejected():
    with pytest.raises(ConfigError, match="betta"):
        make_config(EsampConfig, betta=1.0)


def test_update_returns_a_validated_copy():
    e = EsampConfig()
    e2 = update_config(e, beta=0.0)
    assert (
        e2.steering.beta == 0.0
        and e.steering.beta == 0.8
        and e2.with_steering(mix="unsharpened").steering.mix == "unsharpened"
    )
    with pytest.raises(ConfigError):
        update_config(e, beta=99)


def test_the_engine_settings_hold_a_steering_and_take_its_fields_flat_too():
    from esamp.core.config import ENGINE_FIELDS, Steering

    flat = EsampConfig(beta=1.2, rank=8)
    nested = EsampConfig(rank=8, steering=Steering(beta=1.2))
    assert flat == nested and isinstance(flat.steering, Steering) and "beta" not in ENGINE_FIELDS
    assert EsampConfig.model_validate(flat.model_dump()) == flat  # the JSON form round-trips
    with pytest.raises(ConfigError) as err:
        make_config(EsampConfig, beta=11)
    assert "beta=11" in str(err.value) and "<= 10" in str(err.value)  # named as given, not steering.beta
