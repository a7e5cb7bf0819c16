"""The algorithm every engine runs, readable top to bottom.

- ``config``: every setting once (defaults, ranges, flags); ``payload``: the per-request form
  that travels through vLLM; ``mixes``: the mixes' coefficients.
- ``distiller``: the Distiller bank, one small network per prompt group, trained online.
- ``intervention``: the candidate filter and the mix on the sampler's logits.
- ``novelty``: raw Distiller error → the [0, 1] heat clients show.
- ``steerer``: one ESamp step over a batch of rows, with the plain PyTorch path as the reference.
- ``backends/``: the speed machinery a reader can skip (flat parameter buffers and the fused
  optimizer, the fused mix kernel, CUDA-graph capture), each held equal to the reference by tests.
"""
