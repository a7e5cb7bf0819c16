"""``EsampWorkerExtension``: methods vLLM adds to its worker, called with ``collective_rpc``.

They run in the process that holds the model and the logits processor (the engine core), between
engine steps, and return plain lists, dicts and numbers.
"""

from __future__ import annotations

from esamp.engines.vllm.state import STATE

EXTENSION = "esamp.engines.vllm.extension.EsampWorkerExtension"


class EsampWorkerExtension:
    def esamp_drain(self, release: list[str] | tuple[str, ...] = ()) -> dict:
        """Finished step records and counters of the ESamp processor; frees released groups."""
        processor = STATE.processor
        if processor is None:
            return {"steps": [], "counters": {}, "free_slots": 0, "groups": [], "active": False}
        out = processor.drain(tuple(release))
        out["active"] = processor.bank is not None
        return out

    def esamp_info(self) -> dict:
        """What is running: model class, taps, model runner, bank size (for canaries and the UI)."""
        model, processor = STATE.model, STATE.processor
        runner = getattr(self, "model_runner", None)
        return {
            "model_class": type(model).__name__ if model is not None else None,
            "taps": getattr(model, "esamp_taps", None),
            "aux_layers": getattr(model, "esamp_aux_layers", None),
            "runner_class": type(runner).__name__ if runner is not None else None,
            "runner_module": type(runner).__module__ if runner is not None else None,
            "processor": processor is not None,
            "slots": processor.bank.capacity if processor is not None and processor.bank else 0,
            "taps_put": STATE.taps_put,
        }

    def esamp_memory(self) -> int | None:
        """Peak bytes the torch allocator held on this worker's GPU (None on the CPU)."""
        import torch

        return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None
