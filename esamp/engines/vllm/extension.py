"""``EsampWorkerExtension``: methods vLLM adds to its worker, called with ``collective_rpc``.

They run in the process that holds the model and the logits processor (the engine core), between
engine steps, and return plain lists, dicts and numbers. Under data parallelism every rank has
its own engine core, and ``collective_rpc`` answers for one rank only: a server reads each rank
through its own side channel instead (``esamp.serving``). Under tensor parallelism
``collective_rpc`` runs every method on every worker of the engine and returns their answers in
rank order: ``esamp_release`` then frees a group on every worker (the slot ledgers stay equal),
and records come from rank 0, the only worker that keeps them (``esamp.engines.vllm.tp``); the
library engine reads them through ``esamp_records_channel`` instead, off vLLM's RPC path. What
only ``esamp bench`` calls lives in ``esamp.commands.bench.worker_extension``.
"""

from __future__ import annotations

from esamp.engines.vllm.exchange import exchange_for


def runner_name(worker) -> str:
    """Which model runner a vLLM worker runs: "MRV2" (Model Runner V2, vLLM's default for dense
    models since 0.25) or "V1". The worker's own flag where vLLM has one (0.26 and later), else
    where the runner's class lives (MRV2's in the ``vllm.v1.worker.gpu`` package)."""
    flag = getattr(worker, "use_v2_model_runner", None)
    if isinstance(flag, bool):
        return "MRV2" if flag else "V1"
    module = type(getattr(worker, "model_runner", None)).__module__
    return "MRV2" if module.startswith("vllm.v1.worker.gpu.") else "V1"


class EsampWorkerExtension:
    def _esamp_exchange(self):
        return exchange_for(self.vllm_config)

    def esamp_drain(
        self, release: list[str] | tuple[str, ...] = (), groups: list[str] | None = None, columns: bool = False
    ) -> dict:
        """Finished step records (of ``groups``, or all; rows as columns with ``columns``) and
        counters; frees released groups."""
        steering = self._esamp_exchange().steering
        if steering is None:
            return {"steps": [], "pending": 0, "counters": {}, "free_slots": 0, "groups": [], "active": False}
        out = steering.drain(tuple(release), set(groups) if groups is not None else None, columns)
        out["active"] = steering.slots is not None
        return out

    def esamp_records_channel(self) -> tuple[str, bytes] | None:
        """Where this worker serves its step records from a thread, off vLLM's RPC path (address,
        authentication key): the library engine's fetches (``records_channel``). None on a worker
        that keeps no records (a TP rank other than 0) or without ESamp."""
        steering = self._esamp_exchange().steering
        if steering is None or steering.bank is None:
            return None
        from esamp.engines.vllm.records_channel import server_for

        server = server_for(steering)
        return server.address, server.key

    def esamp_release(self, groups: list[str]) -> int:
        """Free the Distiller slots of ``groups`` (their requests have ended): the API server's
        middleware calls it when a served request ends. Run between engine steps, as every
        ``collective_rpc``; on every data-parallel rank (a group not on this rank is no-op)."""
        steering = self._esamp_exchange().steering
        if steering is None:
            return 0
        return sum(steering.release(group) for group in groups)

    def esamp_info(self) -> dict:
        """What is running: model class, taps, model runner, bank size (for canaries and the UI)."""
        exchange = self._esamp_exchange()
        model, steering = exchange.model, exchange.steering
        runner = getattr(self, "model_runner", None)
        return {
            "model_class": type(model).__name__ if model is not None else None,
            "taps": getattr(model, "esamp_taps", None),
            "aux_layers": getattr(model, "esamp_aux_layers", None),
            "runner_class": type(runner).__name__ if runner is not None else None,
            "runner_module": type(runner).__module__ if runner is not None else None,
            "runner": runner_name(self) if runner is not None else None,  # "V1" or "MRV2"
            "processor": type(exchange.adapter).__name__ if exchange.adapter is not None else None,
            "slots": steering.slots.capacity if steering is not None and steering.slots else 0,
            "distiller": steering.config.distiller if steering is not None and steering.config is not None else None,
            "taps_put": exchange.taps_put,
            # this worker's place in the tensor-parallel group; rank 0 owns the Distiller bank
            "tp_rank": steering.tp.rank if steering is not None else None,
            "tp_size": steering.tp.size if steering is not None else None,
            "owns_bank": steering is not None and steering.bank is not None,
        }
