"""What esamp registers with vLLM, and where.

- ``register``: the ``vllm.general_plugins`` entry point, installed with esamp. It registers the
  ESamp model classes with vLLM's ``ModelRegistry`` in every vLLM process (lazily, by
  ``module:Class`` string: the import stays cheap). A registered class is used only by an engine
  that names it (``hf_overrides``), so this changes nothing for any other engine.
- ESamp's logits processor is **not** installed under ``vllm.logits_processors``: vLLM loads
  every processor of that group into every engine of the environment, and on vLLM 0.21–0.30 with
  Triton (any GPU machine) the mere presence of one sends every engine from Model Runner V2 back to
  the V1 runner. So the entry point lives in a folder of its own (``SCOPE``, a ``.dist-info``
  inside this package) that only the engines esamp starts see: ``processor_scope()`` puts it on
  the path of the process that builds an ESamp engine and of the processes vLLM spawns for it
  (``PYTHONPATH``), and ``scope_env`` does the same for ``esamp serve``'s server (with the scope
  of ``esamp.serving.plugin``, what only a served engine has). Loaded from an entry point rather
  than named in ``logits_processors``, the processor does not make vLLM's V1 runner keep every
  request's output ids and wait for each step's sampled tokens (it does that for processors
  passed by name). The class it names (``entry.EsampLogitsProcessor``) is accepted by
  both of vLLM's loaders and builds the adapter of the runner that loads it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from esamp.engines.vllm.settings import ARCHITECTURES

MODEL_MODULE = "esamp.engines.vllm.model"
GROUP = "vllm.logits_processors"  # vLLM's entry-point group for logits processors
# The class vLLM's loaders build (both the V1 runner's and Model Runner V2's accept it): what the
# scoped entry point names, and the name to give --logits-processors.
PROCESSOR = "esamp.engines.vllm.entry:EsampLogitsProcessor"
SCOPE = Path(__file__).resolve().with_name("scope")  # a path entry holding only that entry point


def register() -> None:
    """Register every ESamp architecture with vLLM's ``ModelRegistry`` (idempotent)."""
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    for esamp_arch in ARCHITECTURES.values():
        if esamp_arch not in known:
            ModelRegistry.register_model(esamp_arch, f"{MODEL_MODULE}:{esamp_arch}")


def scope_env(env: dict[str, str] | None = None, scopes: tuple[Path, ...] = (SCOPE,)) -> dict[str, str]:
    """``env`` (default: this process's) with ``scopes`` (default: ``SCOPE``) first on
    ``PYTHONPATH``: for a process that runs one ESamp engine or server and nothing else."""
    env = dict(os.environ if env is None else env)
    first = [str(scope) for scope in scopes]
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
    env["PYTHONPATH"] = os.pathsep.join([*first, *paths])
    return env


@contextlib.contextmanager
def processor_scope():
    """While an ESamp engine is built: ESamp's logits-processor entry point visible to vLLM here
    and in the processes it spawns, and gone again afterwards (a plain engine built later in this
    process sees none of it)."""
    scope = str(SCOPE)
    added = scope not in sys.path
    before = os.environ.get("PYTHONPATH")
    if added:
        sys.path.insert(0, scope)
    os.environ["PYTHONPATH"] = scope_env()["PYTHONPATH"]
    try:
        yield
    finally:
        if added and scope in sys.path:
            sys.path.remove(scope)
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def processor_visible() -> bool:
    """Whether ESamp's logits-processor entry point is visible in this process (an engine esamp
    started, ``processor_scope``): vLLM then builds the processor itself, without waiting for each
    step's sampled tokens as it does for processors passed by name, and it must not be named again."""
    from importlib.metadata import entry_points

    return any(ep.value == PROCESSOR for ep in entry_points(group=GROUP))
