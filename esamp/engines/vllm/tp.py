"""``TensorParallel``: where one worker stands in vLLM's tensor-parallel group, as ESamp sees it.

Under tensor parallelism every worker runs the model's ``compute_logits`` and the logits processor
on the same rows (the residual stream and the gathered logits are replicated) and samples its own
copy of every token; vLLM relies on the copies agreeing. A Distiller per worker would not keep
them equal: its training step sums in float with atomics, so the banks could drift apart by
rounding and one differently drawn token would desynchronise the workers. So one worker, TP rank
0, owns the Distiller bank: it runs the Distiller step and broadcasts ŷ (steered rows × hidden)
over vLLM's tensor-parallel group. Every worker then computes d = W·ŷ with its shard of the LM
head (gathered like the logits), the filter, the mix and the draw from identical inputs. The other
workers hold no bank, only a ``SlotLedger`` that assigns slots as rank 0's bank does, so every
worker builds the same plan for every step.

The broadcast is vLLM's ``GroupCoordinator.broadcast`` on the group's device communicator (NCCL
on GPUs: queued on the current stream, no host sync, capturable; gloo on a CPU), into a buffer at
a fixed address on the receiving workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0  # this worker's rank in the tensor-parallel group
    size: int = 1  # workers in the group
    group: Any = None  # vLLM's GroupCoordinator (None: one worker)

    @property
    def owner(self) -> bool:
        """Whether this worker owns the Distiller bank (TP rank 0)."""
        return self.rank == 0

    def share(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` from rank 0 on every worker, in place (contiguous; the same shape and dtype
        on every worker)."""
        if self.size == 1:
            return tensor
        return self.group.broadcast(tensor, src=0)


ALONE = TensorParallel()


def tensor_parallel(vllm_config) -> TensorParallel:
    """This worker's place in the tensor-parallel group of the engine ``vllm_config`` describes
    (called in the worker, after vLLM set up its groups)."""
    size = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
    if size == 1:
        return ALONE
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return TensorParallel(group.rank_in_group, group.world_size, group)
