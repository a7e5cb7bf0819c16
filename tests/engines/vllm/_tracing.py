"""A logits processor that records what every steered step saw and did (tests only).

It subclasses the production adapters with a steering subclass, so the hot path stays free of test
hooks; an engine built with ``llm_kwargs={"logits_processors": [TRACER]}`` runs it instead of the
plain one (the adapter built last is the live one). Like ``entry.EsampLogitsProcessor`` it is a
class of both vLLM interfaces that builds the adapter of the runner that loads it: the V1 runner's
or Model Runner V2's (whose loader refuses a class of the V1 interface alone, so that every
engine of these tests failed to start on a GPU with vLLM 0.33, where MRV2 is the default). Below
it, what the tests of such an engine share: ``traced()`` to keep the steps of a block,
``collect`` to run groups to their end.
"""

from __future__ import annotations

import functools

from esamp.engines.vllm.entry import EsampLogitsProcessor, runner_of
from esamp.engines.vllm.v1 import V1Adapter

from _trace_steering import TracingSteering

TRACER = "_tracing:TracingProcessor"


class _Tracing:
    steering_class = TracingSteering

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The entry point's adapter may have made the engine's steering first: trace it anyway.
        if not isinstance(self.steering, TracingSteering):
            self.steering.__class__ = TracingSteering


class TracingV1(_Tracing, V1Adapter):
    pass


@functools.cache
def _tracing_mrv2():
    from esamp.engines.vllm.mrv2 import Mrv2Adapter  # vLLM >= 0.31

    class TracingMrv2(_Tracing, Mrv2Adapter):
        pass

    return TracingMrv2


class TracingProcessor(EsampLogitsProcessor):
    """What vLLM's loaders build for ``TRACER``: the tracing adapter of the runner that asks."""

    def __new__(cls, vllm_config, *args, **kwargs):
        adapter = _tracing_mrv2() if runner_of(args) == "mrv2" else TracingV1
        return adapter(vllm_config, *args, **kwargs)


# -- driving a traced engine in this process ---------------------------------------------------


def exchange():
    """The exchange of the module's engine (in this process: the tests run the engine core here)."""
    from esamp.engines.vllm.exchange import live_exchanges

    found = [x for x in live_exchanges() if isinstance(x.adapter, _Tracing)]
    assert found, "the ESamp logits processor is not in this process"
    return found[-1]


def steering():
    return exchange().steering


class traced:
    """``with traced() as trace:`` — the steered steps the processor saw inside the block."""

    def __enter__(self) -> list[dict]:
        self.p = steering()
        self.p.traces = []
        return self.p.traces

    def __exit__(self, *exc) -> None:
        self.p.traces = []  # the block's list stays with the caller


def collect(engine, starts, max_steps=400):
    """Run groups to the end; ``starts`` maps a step number to a list of start() kwargs."""
    events, step, keys = [], 0, []
    while True:
        for kw in starts.get(step, []):
            keys.append(engine.start(**kw))
        if not engine.has_unfinished() and step > max(starts):
            break
        events += engine.step()
        step += 1
        assert step < max_steps
    engine.drain()
    return keys, events


def tokens_of(events, group, sample):
    return [e.token_id for e in events if e.type == "token" and e.group == group and e.sample == sample]


def kept_by_both(got, want, scaled):
    """The candidates both sides kept, once their sets are held equal up to ties at the cut.

    ``got`` is the engine's steered row set (-inf where filtered), ``want`` the core's; ``scaled``
    the logits over T. vLLM's top-k keeps every token tied with the k-th value, and at a top-p
    cut the fused filter keeps or drops a tied group whole where a sort keeps part of it (bf16
    logits tie often): the two sets may differ, but only inside the tie group at the cut, so
    every token one side alone kept has the value of the lowest token the core kept."""
    import torch

    kept_got, kept_want = torch.isfinite(got).cpu(), torch.isfinite(want).cpu()
    scaled = scaled.cpu()
    differ = kept_got ^ kept_want
    for r in differ.any(-1).nonzero().flatten().tolist():
        lowest = scaled[r][kept_want[r]].min()
        assert (scaled[r][differ[r]] == lowest).all(), f"row {r}: the candidate sets differ away from the cut"
    return kept_want & kept_got
