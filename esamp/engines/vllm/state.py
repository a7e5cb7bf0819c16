"""Per-process meeting point of the model class, the logits processor and the worker extension.

All three live in the process that runs the model (vLLM's engine core, or the caller's process
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The model hands over one step's tapped rows through
``put_taps``; the processor takes them in the same step with ``take_taps``. Nothing here is a row
index: the taps are in logits-row order for exactly one step and are consumed once.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass
class Taps:
    source: torch.Tensor  # [R, H] layers[src].input_layernorm of the residual stream entering src
    target: torch.Tensor  # [R, H] layers[tgt].input_layernorm of the residual stream entering tgt


class _ProcessState:
    def __init__(self) -> None:
        self._model = None
        self._processor = None
        self._taps: Taps | None = None
        self.taps_put = 0  # compute_logits calls that delivered taps

    # the model --------------------------------------------------------------------------------
    def set_model(self, model) -> None:
        self._model = weakref.ref(model)

    @property
    def model(self):
        return self._model() if self._model is not None else None

    # the processor ----------------------------------------------------------------------------
    def set_processor(self, processor) -> None:
        self._processor = weakref.ref(processor)

    @property
    def processor(self):
        return self._processor() if self._processor is not None else None

    # one step's taps --------------------------------------------------------------------------
    def put_taps(self, source: torch.Tensor, target: torch.Tensor) -> None:
        self._taps = Taps(source, target)
        self.taps_put += 1

    def take_taps(self) -> Taps | None:
        taps, self._taps = self._taps, None
        return taps


STATE = _ProcessState()
