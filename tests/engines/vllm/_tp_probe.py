"""A worker extension for the tensor-parallel tests: what each worker drew (tests only).

Every tensor-parallel worker samples its own copy of each token and feeds it back as its next
input; these methods let a test read every worker's copy through ``collective_rpc``.
"""

from __future__ import annotations

from esamp.engines.vllm.extension import EsampWorkerExtension

PROBE = "_tp_probe.TensorParallelProbe"


class TensorParallelProbe(EsampWorkerExtension):
    def esamp_test_generated(self) -> dict[str, list[int]]:
        """Every running request's generated tokens, as this worker drew them."""
        return {rid: list(state.output_token_ids) for rid, state in self.model_runner.requests.items()}

    def esamp_test_module(self) -> str:
        """Where this worker imported esamp from (the checkout under test, not another install)."""
        import esamp

        return esamp.__file__

    def esamp_test_watch(self) -> None:
        """From now on keep, for every steered row of every step, its mixed logits' largest values
        (what the draw sees) and its Distiller logits d = W·ŷ summed over each third of the
        vocabulary (each worker's shard of the head gives one third at TP = 3), with its group,
        sample and generation index."""
        import torch

        from esamp.core.intervention import dense_logits

        steering = self._esamp_exchange().steering
        seen = self._esamp_seen = []
        apply = steering.apply

        def watched(plan, logits, handoff):
            out = apply(plan, logits, handoff)
            s = plan.steered
            if s:
                top = out.index_select(0, plan.step.index[:s]).float().topk(5, dim=-1).values
                d = dense_logits(handoff.d, steering.vocab)[:s, : steering.vocab].float()
                thirds = [part.sum(-1, keepdim=True) for part in d.chunk(3, dim=-1)]
                values = torch.cat([top, *thirds], dim=-1).tolist()
                seen.extend((m.group, m.sample, len(m.output_ids), v) for m, v in zip(plan.members, values))
            return out

        steering.apply = watched

    def esamp_test_seen(self) -> list:
        return list(getattr(self, "_esamp_seen", []))
