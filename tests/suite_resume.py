"""Where a GPU suite run starts (``ESAMP_TEST_FROM``, set by ``benchmarks/gpu_suite.sh`` from
``SUITE_FROM``); ``tests/conftest.py`` applies it to every session's collected tests."""

from __future__ import annotations

import pytest


def resume_from(config, items, start: str | None) -> None:
    """Run ``items`` (in their order) from the first whose id starts with ``start``: a GPU suite
    that a device call's time limit cut goes on where it stopped (``SUITE_FROM`` in
    ``benchmarks/gpu_suite.sh``). The tests before it are deselected, as ``-k`` would."""
    if not start:
        return
    at = next((i for i, item in enumerate(items) if item.nodeid.startswith(start)), None)
    if at is None:
        raise pytest.UsageError(
            f"ESAMP_TEST_FROM={start}: no collected test's id starts so; give a test's id or its file's "
            "path as pytest prints them (e.g. tests/engines/vllm/test_units.py)"
        )
    config.hook.pytest_deselected(items=items[:at])
    del items[:at]
