"""Per-process meeting point of the model class, the logits processor and the worker extension.

All three live in the process that runs the model (vLLM's engine core, or the caller's process
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The model hands one step's tapped rows (in logits-row
order) to the processor's ``distill`` and the Distiller logits to ``take_distiller_logits``; the
processor's ``apply`` consumes both in the same step. Nothing here is a row index.
"""

from __future__ import annotations

import weakref


class _ProcessState:
    def __init__(self) -> None:
        self._model = None
        self._processor = None
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


STATE = _ProcessState()
