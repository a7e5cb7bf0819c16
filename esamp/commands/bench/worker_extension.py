"""``EsampBenchExtension``: the engine's worker extension plus what only ``esamp bench`` calls
(through ``collective_rpc``, by name; vLLM mixes the class named by ``BENCH_EXTENSION`` into its
worker).

``--logits realistic`` reshapes the dummy model's LM head so its next-token distributions look
like a real model's (``calibrate``); peak memory goes into the bench's report.
``benchmarks/serve_bench.py --logits realistic`` gives both its servers this extension and calls
the head's methods through vLLM's ``POST /collective_rpc``.
"""

from __future__ import annotations

from esamp.engines.vllm.extension import EsampWorkerExtension

BENCH_EXTENSION = "esamp.commands.bench.worker_extension.EsampBenchExtension"
HEAD_BLOCK = 8192  # LM-head rows rescaled at a time


class EsampBenchExtension(EsampWorkerExtension):
    def _esamp_head(self):
        """(the head's weight, the final norm's weight, this worker's token rows in it, the first
        token they hold). Under tensor parallelism each worker holds one contiguous vocabulary
        shard, in rank order, so every worker's answers joined in rank order cover the vocabulary."""
        model = self.model_runner.model
        shard = getattr(model.lm_head, "shard_indices", None)
        if shard is not None and self.vllm_config.parallel_config.tensor_parallel_size > 1:
            return model.lm_head.weight, model.model.norm.weight, shard.num_org_elements, shard.org_vocab_start_index
        vocab = int(self.model_runner.model_config.get_vocab_size())
        return model.lm_head.weight, model.model.norm.weight, vocab, 0

    def esamp_head_sigma(self) -> list[float]:
        """Per token v of this worker's rows, the spread of its logit W_v·h over hidden states
        h = w ⊙ x̂ of the final norm (x̂ with unit variance per dimension): σ_v = sqrt(Σ_i W_vi² w_i²)."""
        import torch

        weight, norm, vocab, _ = self._esamp_head()
        with torch.no_grad():
            return (weight[:vocab].float().pow(2) @ norm.float().pow(2)).sqrt().cpu().tolist()

    def esamp_scale_head(self, factors: list[float] | None) -> None:
        """Multiply the LM head's rows by ``factors`` (one per token of the whole vocabulary; a
        worker takes its shard's), in place, so that captured CUDA graphs see it too; None restores
        the weights as loaded."""
        import torch

        weight, _, vocab, first = self._esamp_head()
        with torch.no_grad():
            if getattr(self, "_esamp_head_copy", None) is None:
                self._esamp_head_copy = weight[:vocab].to("cpu", copy=True)
            f = (
                None
                if factors is None
                else torch.tensor(factors[first : first + vocab], dtype=torch.float32, device=weight.device).unsqueeze(
                    1
                )
            )
            # In blocks of rows: a float32 copy of a 7B head is 2 GiB, more than a GPU shared by
            # the bench's three engines has free.
            for start in range(0, vocab, HEAD_BLOCK):
                rows = weight[start : min(vocab, start + HEAD_BLOCK)]
                rows.copy_(self._esamp_head_copy[start : start + len(rows)])
                if f is not None:
                    rows.copy_((rows.float() * f[start : start + len(rows)]).to(rows.dtype))
            if factors is None:
                self._esamp_head_copy = None

    def esamp_memory(self) -> int | None:
        """Peak bytes the torch allocator held on this worker's GPU (None on the CPU)."""
        import torch

        return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None

    def esamp_host_profile(self, action: str, top: int = 30) -> str | None:
        """cProfile of this worker's own thread, the one that runs its engine steps: ``"start"``,
        then ``"stop"`` returns the functions with the most time (by own time, then cumulative).
        What ``benchmarks/profile_host.py`` reads from every worker under tensor parallelism,
        where the workers are processes of their own."""
        import cProfile
        import io
        import pstats

        if action == "start":
            self._esamp_profile = cProfile.Profile()
            self._esamp_profile.enable()
            return None
        if action != "stop":
            raise ValueError(f"action must be 'start' or 'stop', not {action!r}")
        profile, self._esamp_profile = getattr(self, "_esamp_profile", None), None
        if profile is None:
            return None
        profile.disable()
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
        return text.getvalue()

    def esamp_gc(self, action: str) -> dict | None:
        """Python's garbage collections in this worker's process (the engine core's when it runs one
        worker; a worker's own under tensor parallelism), each a pause of every thread of it: ``"start"``
        counts from now, ``"stop"`` returns, per generation, the collections, their seconds in all
        and the longest, and stops counting."""
        from esamp.commands.bench.gc_pauses import GcPauses

        if action not in ("start", "stop"):
            raise ValueError(f"action must be 'start' or 'stop', not {action!r}")
        pauses = getattr(self, "_esamp_gc", None)
        if pauses is None:
            pauses = self._esamp_gc = GcPauses()
        if action == "stop":
            return pauses.stop()
        pauses.start()
        return None
