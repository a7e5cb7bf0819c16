"""``EsampWorkerExtension``: methods vLLM adds to its worker, called with ``collective_rpc``.

They run in the process that holds the model and the logits processor (the engine core), between
engine steps, and return plain lists, dicts and numbers. Under data parallelism every rank has
its own engine core, and ``collective_rpc`` answers for one rank only: a server reads each rank
through its own side channel instead (``esamp.serving``).
"""

from __future__ import annotations

from esamp.engines.vllm.state import STATE


class EsampWorkerExtension:
    def esamp_drain(self, release: list[str] | tuple[str, ...] = (), groups: list[str] | None = None) -> dict:
        """Finished step records (of ``groups``, or all) and counters; frees released groups."""
        processor = STATE.processor
        if processor is None:
            return {"steps": [], "pending": 0, "counters": {}, "free_slots": 0, "groups": [], "active": False}
        out = processor.drain(tuple(release), set(groups) if groups is not None else None)
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

    # -- esamp bench --logits realistic ---------------------------------------------------------

    def _esamp_head(self):
        model = self.model_runner.model
        vocab = int(self.model_runner.model_config.get_vocab_size())
        return model.lm_head.weight, model.model.norm.weight, vocab

    def esamp_head_sigma(self) -> list[float]:
        """Per token v, the spread of its logit W_v·h over hidden states h = w ⊙ x̂ of the final
        norm (x̂ with unit variance per dimension): σ_v = sqrt(Σ_i W_vi² w_i²)."""
        import torch

        weight, norm, vocab = self._esamp_head()
        with torch.no_grad():
            return (weight[:vocab].float().pow(2) @ norm.float().pow(2)).sqrt().cpu().tolist()

    def esamp_scale_head(self, factors: list[float] | None) -> None:
        """Multiply the LM head's rows by ``factors`` (one per token), in place, so that captured
        CUDA graphs see it too; None restores the weights as loaded."""
        import torch

        weight, _, vocab = self._esamp_head()
        with torch.no_grad():
            if getattr(self, "_esamp_head_copy", None) is None:
                self._esamp_head_copy = weight[:vocab].to("cpu", copy=True)
            weight[:vocab].copy_(self._esamp_head_copy.to(weight.device))
            if factors is None:
                self._esamp_head_copy = None
                return
            f = torch.tensor(factors, dtype=torch.float32, device=weight.device).unsqueeze(1)
            weight[:vocab].copy_((weight[:vocab].float() * f).to(weight.dtype))

    def esamp_memory(self) -> int | None:
        """Peak bytes the torch allocator held on this worker's GPU (None on the CPU)."""
        import torch

        return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None
