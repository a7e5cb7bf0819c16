import importlib.util
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if os.environ.get("ESAMP_TEST_ORDER") == "reverse":  # the GPU suite must pass in any order
        items.reverse()
    no_cuda = not torch.cuda.is_available()
    no_vllm = importlib.util.find_spec("vllm") is None
    for item in items:
        if no_cuda and "cuda" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if no_vllm and "vllm" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs vLLM installed"))


@pytest.fixture(scope="session")
def reference_engine():
    """One reference engine on the embedded model for the whole test session."""
    from esamp.engines.reference import ReferenceEngine

    engine = ReferenceEngine()
    yield engine
    engine.close()
