"""Steps that other packages add to an engine, run where its steering is built.

``make_steering`` (``steering``) builds an engine's ``EngineSteering`` in each process that runs
the model: every tensor-parallel worker, and the engine core of every data-parallel rank. Once it
has, it calls every step registered here in that process with the new steering and the engine's
vLLM configuration. The engine room registers none, so a library engine runs nothing more than
its steering. ``esamp serve`` registers its steps (the side channel, the workers' stop signals)
through a vLLM plugin that only its own processes load (``esamp.serving.plugin``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Step = Callable[[Any, Any], None]  # step(steering, vllm_config)

_STEPS: list[Step] = []


def when_steering_ready(step: Step) -> None:
    """Call ``step(steering, vllm_config)`` each time this process builds an engine's steering
    (registered once, however often this is called)."""
    if step not in _STEPS:
        _STEPS.append(step)


def steering_ready(steering, vllm_config) -> None:
    """Run the registered steps, in the order they were registered (``make_steering`` calls this)."""
    for step in list(_STEPS):
        step(steering, vllm_config)
