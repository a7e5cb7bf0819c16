"""A GPU suite cut by a device call's limit goes on where it stopped (``ESAMP_TEST_FROM``, which
``benchmarks/gpu_suite.sh`` sets from ``SUITE_FROM``), in file order or reversed."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from suite_resume import resume_from  # tests/ is on the path (tests/conftest.py imports it too)


def _items(*ids: str) -> list:
    return [NS(nodeid=i) for i in ids]


def _config(dropped: list):
    return NS(hook=NS(pytest_deselected=lambda items: dropped.extend(i.nodeid for i in items)))


IDS = ("tests/a.py::test_1", "tests/a.py::test_2", "tests/b/test_c.py::test_3", "tests/b/test_c.py::test_4")


def test_the_suite_goes_on_from_a_file_or_a_test():
    items, dropped = _items(*IDS), []
    resume_from(_config(dropped), items, "tests/b/test_c.py")
    assert [i.nodeid for i in items] == list(IDS[2:]) and dropped == list(IDS[:2])
    items, dropped = _items(*IDS), []
    resume_from(_config(dropped), items, "tests/a.py::test_2")
    assert [i.nodeid for i in items] == list(IDS[1:]) and dropped == [IDS[0]]


def test_in_reverse_it_goes_on_in_reverse():
    items, dropped = _items(*reversed(IDS)), []
    resume_from(_config(dropped), items, "tests/a.py")
    assert [i.nodeid for i in items] == [IDS[1], IDS[0]] and len(dropped) == 2


def test_nothing_is_dropped_without_a_start_and_a_wrong_start_says_so():
    items, dropped = _items(*IDS), []
    resume_from(_config(dropped), items, None)
    assert len(items) == 4 and dropped == []
    with pytest.raises(pytest.UsageError, match="no collected test's id starts so"):
        resume_from(_config(dropped), _items(*IDS), "tests/nowhere.py")
    assert dropped == []
