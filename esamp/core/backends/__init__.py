"""Speed backends of the core: the fused optimizer, the Triton mix and filter, the CUDA-graph step (each held equal
to the PyTorch reference by tests/core)."""
