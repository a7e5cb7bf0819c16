"""What ``esamp serve`` adds to its engines, and how it reaches them.

A served engine has two things a library engine has not: a side channel per data-parallel rank
(``channel``) and workers that put off a stop signal (``shutdown``). Both belong in the processes
that run the model, which ``esamp serve`` never touches directly. They get there through vLLM's
general plugins: vLLM runs every ``vllm.general_plugins`` entry point in each of its processes,
the API server, every engine core and every worker of an engine core (``load_general_plugins``,
called by vLLM's engine core and its worker set-up before the model and the logits processors are
built).

The entry point naming ``register`` sits in a folder of its own (``SCOPE``, a ``.dist-info``
inside this package) that ``esamp serve`` puts on its server's ``PYTHONPATH``, so only the
processes of ``esamp serve`` load it: an engine the library builds never sees it, and never
starts a thread or replaces a signal handler. ``register`` hands the engine room one step
(``esamp.engines.vllm.hooks``), run where an engine's steering is built, which for an engine
whose settings carry ``esamp_server`` (what ``esamp serve`` writes):

- starts the rank's side channel on the worker that owns the Distiller bank (the rank's only
  worker, or TP rank 0 under tensor parallelism; every data-parallel rank has one);
- puts off a stop signal on every worker.

vLLM's ``VLLM_PLUGINS``, when set, names the plugins it loads: a served engine then needs
``esamp_serving`` in it beside ``esamp``.
"""

from __future__ import annotations

from pathlib import Path

from esamp.engines.vllm import hooks
from esamp.engines.vllm.settings import server_settings
from esamp.serving import channel
from esamp.serving.shutdown import worker_waits_for_engine_core

ENTRY = "esamp.serving.plugin:register"  # what the scoped entry point names
SCOPE = Path(__file__).resolve().with_name("scope")  # a path entry holding only that entry point
CHANNELS: list[channel.Channel] = []  # the side channels this process started


def register() -> None:
    """The ``vllm.general_plugins`` entry point: ``serve_engine`` for every engine of this process."""
    hooks.when_steering_ready(serve_engine)


def serve_engine(steering, vllm_config) -> None:
    """What a served engine adds once ``steering`` is built (nothing for an engine ``esamp serve``
    did not start)."""
    settings = server_settings(vllm_config)
    if not settings:
        return
    if steering.config is not None and steering.tp.owner:  # the worker with the bank has the records
        started = channel.start(steering, settings, vllm_config)
        if started is not None:
            CHANNELS.append(started)
    worker_waits_for_engine_core()  # a stop signal to every process must not cut a step in half
