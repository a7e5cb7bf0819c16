"""A logits processor that records what every steered step saw and did (tests only).

It subclasses the production adapter with a steering subclass, so the hot path stays free of test
hooks; an engine built with ``llm_kwargs={"logits_processors": [TRACER]}`` runs it instead of the
plain one (the adapter built last is the live one).
"""

from __future__ import annotations

from esamp.engines.vllm.processor import EsampLogitsProcessor
from esamp.engines.vllm.steering import EngineSteering

TRACER = "_tracing:TracingProcessor"


class TracingSteering(EngineSteering):
    traces: list[dict] = []  # every steered step, oldest first (tests clear it)
    _trace: dict | None = None

    def distill(self, plan, source, target, normalize, head_dtype):
        handoff = super().distill(plan, source, target, normalize, head_dtype)
        s, H = plan.steered, self.hidden
        taps = self._taps.index_select(0, plan.step.index[:s])
        x, y = taps[:, source * H:(source + 1) * H], taps[:, target * H:(target + 1) * H]
        if normalize is not None:
            x, y = normalize(x, y)
        losses = {}
        if handoff.losses is not None:
            losses = {g: v for g, v in zip(plan.unit_groups, handoff.losses.tolist()) if g is not None}
        m = plan.members
        self._trace = dict(meta=[(r.group, r.sample, len(r.output_ids)) for r in m],
                           filters=[r.filters for r in m], steering=[r.steering for r in m],
                           source=x.float().clone(), target=y.float().clone(),
                           prediction=handoff.prediction[:s].float().clone(), errors=handoff.errors[:s].clone(),
                           losses=losses)
        return handoff

    def apply(self, plan, logits, handoff):
        trace, self._trace = self._trace, None
        index = plan.step.index[:plan.steered]
        raw = logits.index_select(0, index).clone() if trace is not None else None
        out = super().apply(plan, logits, handoff)
        if trace is not None and handoff is not None and handoff.d is not None:
            self.traces.append(dict(trace, logits=raw, steered=out.index_select(0, index).clone(),
                                    distiller_logits=handoff.d.float().clone()))
        return out


class TracingProcessor(EsampLogitsProcessor):
    steering_class = TracingSteering

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The entry point's adapter may have made the engine's steering first: trace it anyway.
        if not isinstance(self.steering, TracingSteering):
            self.steering.__class__ = TracingSteering
