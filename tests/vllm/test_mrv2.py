"""The MRV2 adapter driven through vLLM's own MRV2 interface classes (``LogitsProcRequestState``,
``LogitsContext``) with CPU tensors, beside the V1 adapter driven through ``BatchUpdate`` on the
same requests: rows reordered and slots recycled between steps, the logits each request gets
compared row by row. (No running MRV2 engine is within reach: vLLM's MRV2 needs Triton with a
driver; docs/vllm.md.)

The draft adapter does not steer yet (``esamp/engines/vllm/mrv2.py``): both adapters run with no
taps delivered here, where each applies every ESamp request's own filters exactly.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _vllm_helpers import require_vllm

pytestmark = [pytest.mark.vllm]

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec(
        "vllm.v1.worker.gpu.sample.logits_processor") is None:
    pytest.skip("MRV2 logits-processor interface: vLLM >= 0.31", allow_module_level=True)

V, H, SLOTS = 64, 8, 8


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require_vllm()


def _config():
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm import settings as es

    class Config:  # a VllmConfig's shape: takes weak references, is not hashable
        __hash__ = None
        model_config = SimpleNamespace(get_vocab_size=lambda: V, get_hidden_size=lambda: H, logits_processors=None)
        additional_config = {es.KEY: es.engine_settings(EsampConfig(), 4)}

    return Config()


def _request(group: str, sample: int, **filters):
    from vllm import SamplingParams

    from esamp.core.config import SamplingConfig, Steering
    from esamp.engines.vllm import settings as es

    params = SamplingParams(n=1, max_tokens=8, seed=None, **filters,
                            extra_args=es.request_payload(group, sample, Steering(), SamplingConfig(n=2)))
    es.prepare(params)  # what vLLM's frontend does through validate_params
    return params


def _mrv2_ctx(slots: list[int], seq_lens: list[int]):
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

    mapping = torch.tensor(slots, dtype=torch.int32)
    return LogitsContext(expanded_idx_mapping=mapping, idx_mapping=mapping, idx_mapping_np=np.array(slots, dtype=np.int32),
                         expanded_local_pos=torch.zeros(len(slots), dtype=torch.int32),
                         input_ids=torch.zeros(len(slots), dtype=torch.int32),
                         pos=torch.tensor(seq_lens, dtype=torch.int64) - 1,
                         seq_lens_upper_bound_np=np.array(seq_lens, dtype=np.int32))


def test_mrv2_adapter_gives_the_v1_adapters_logits_with_rows_reordered_and_slots_recycled():
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState

    from esamp.engines.vllm.entry import EsampLogitsProcessor

    prompt_len = np.zeros(SLOTS, dtype=np.int32)
    rstate = LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=SLOTS, vocab_size=V,
                                    all_token_ids=None, prompt_len=SimpleNamespace(np=prompt_len),
                                    prefill_len=None, total_len=None)
    v1 = EsampLogitsProcessor(_config(), torch.device("cpu"), False)  # as vLLM's V1 loader builds it
    v2 = EsampLogitsProcessor(_config(), rstate)  # as MRV2's loader builds it
    assert type(v1).__name__ == "EsampLogitsProcessor" and type(v2).__name__ == "EsampMrv2LogitsProcessor"

    from vllm import SamplingParams

    requests = {  # name → (params, prompt length)
        "a0": (_request("ga", 0, temperature=0.7, top_p=0.9), 5),
        "a1": (_request("ga", 1, temperature=0.7, top_p=0.9), 5),
        "b0": (_request("gb", 0, temperature=1.0, top_k=5, min_p=0.1), 3),
        "plain": (SamplingParams(n=1, temperature=0.8, top_p=0.5), 4),  # not ESamp: vLLM filters it
        "c0": (_request("gc", 0, temperature=0.0), 2),
    }
    # The batch of each step, in V1's row order and MRV2's; MRV2 reorders rows and gives c0 the
    # slot b0 left (no remove call: the new add_request overwrites it).
    steps = [
        (["a0", "a1", "b0", "plain"], ["b0", "plain", "a1", "a0"]),
        (["a0", "a1", "b0", "plain"], ["a0", "b0", "a1", "plain"]),
        (["a0", "a1", "c0", "plain"], ["c0", "a1", "plain", "a0"]),
        (["a0", "c0", "plain"], ["plain", "c0", "a0"]),
    ]
    mrv2_slot = {"a0": 3, "a1": 0, "b0": 5, "plain": 1, "c0": 5}
    v1_rows: dict[str, int] = {}
    outputs = {name: [] for name in requests}  # V1's live output-id lists
    generated = {name: 0 for name in requests}
    gen = torch.Generator().manual_seed(0)
    for step, (v1_order, v2_order) in enumerate(steps):
        # V1: rows removed, then added (index, params, prompt ids, output ids)
        now = {n: i for i, n in enumerate(v1_order)}
        removed = [i for n, i in v1_rows.items() if now.get(n) != i]
        added = [(i, requests[n][0], None, outputs[n]) for n, i in now.items() if v1_rows.get(n) != i]
        v1_rows = now
        v1.update_state(BatchUpdate(batch_size=len(v1_order), removed=removed, added=added, moved=[]))
        # MRV2: add_request for requests new to their slot
        for name in v2_order:
            slot = mrv2_slot[name]
            if step == 0 or (name == "c0" and step == 2):
                prompt_len[slot] = requests[name][1]
                v2.add_request(slot, requests[name][0])
        raw = {n: torch.randn(V, generator=gen) for n in requests}
        v1_logits = torch.stack([raw[n] for n in v1_order])
        v2_logits = torch.stack([raw[n] for n in v2_order])
        # the model's compute_logits asks for a plan first: MRV2 gives none (no row order yet)
        assert v2.plan(len(v2_order)) is None
        v1_out = v1.apply(v1_logits.clone())
        seq_lens = [requests[n][1] + generated[n] for n in v2_order]
        v2_out = v2.apply(v2_logits.clone(), _mrv2_ctx([mrv2_slot[n] for n in v2_order], seq_lens))
        for name in v2_order:
            got, want = v2_out[v2_order.index(name)], v1_out[v1_order.index(name)]
            assert torch.equal(got, want), (step, name)
            if name == "plain":
                assert torch.equal(got, raw[name])  # left to vLLM's own filters
            elif name == "b0":
                assert int(torch.isfinite(got).sum()) <= 5  # its own top-k, applied by ESamp
            if name != "plain":  # the generation index, as V1 reads it from the live list
                assert len(v2.slots[mrv2_slot[name]].output_ids) == len(outputs[name]) == generated[name]
        for name in v1_order:
            outputs[name].append(1)
            generated[name] += 1
    assert v2.counters["stash_miss"] == v1.counters["stash_miss"] == len(steps)
    assert v2.drain()["counters"]["steps"] == len(steps)  # the worker extension drains through us


def test_mrv2_adapter_skips_plain_requests_and_engines_without_esamp():
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState

    from esamp.engines.vllm.entry import EsampLogitsProcessor

    rstate = LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=SLOTS, vocab_size=V, all_token_ids=None,
                                    prompt_len=SimpleNamespace(np=np.zeros(SLOTS, dtype=np.int32)),
                                    prefill_len=None, total_len=None)
    built = EsampLogitsProcessor(_config(), rstate)
    assert built.add_request(0, SamplingParams(temperature=0.5)) is False
    assert built.add_request(1, _request("g", 0)) is True
    assert built.add_request(1, SamplingParams()) is False and 1 not in built.slots  # the slot's new occupant
    logits = torch.randn(2, V)
    assert built.apply(logits, _mrv2_ctx([0, 1], [3, 3])) is logits  # nothing of ours in the batch
