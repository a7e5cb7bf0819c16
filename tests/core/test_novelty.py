from esamp.core.novelty import NoveltyNormalizer


def test_first_step_is_neutral_then_in_unit_interval():
    norm = NoveltyNormalizer()
    assert norm.normalise("g", [1.0, 2.0, 3.0]) == [0.5, 0.5, 0.5]
    values = norm.normalise("g", [0.1, 2.0, 50.0])
    assert all(0.0 <= v <= 1.0 for v in values)
    assert values[0] < 0.5 < values[2] and values == sorted(values)


def test_groups_are_normalised_separately_and_forget_resets():
    norm = NoveltyNormalizer()
    norm.normalise("a", [1.0])
    norm.normalise("b", [100.0])
    assert norm.normalise("a", [2.0])[0] > 0.5
    assert norm.normalise("b", [2.0])[0] < 0.5
    norm.forget("a")
    assert norm.normalise("a", [7.0]) == [0.5]


def test_empty_step_is_a_no_op():
    assert NoveltyNormalizer().normalise("g", []) == []
