"""A logits processor that records what every steered step saw and did (tests only).

It subclasses the production processor, so the hot path stays free of test hooks; an engine
built with ``llm_kwargs={"logits_processors": [TRACER]}`` runs it instead of the plain one.
"""

from __future__ import annotations

from esamp.engines.vllm.processor import EsampLogitsProcessor

TRACER = "_tracing:TracingProcessor"


class TracingProcessor(EsampLogitsProcessor):
    traces: list[dict] = []  # every steered step, oldest first (tests clear it)

    def distill(self, plan, source, target, normalize=None, hidden=None):
        out = super().distill(plan, source, target, normalize, hidden)
        prediction = out if hidden is None else out[hidden.shape[0]:].float()
        if normalize is not None:
            source, target = normalize(source, target)
        ctx = self._ctx
        self._trace = dict(
            meta=[(r.group, r.sample, len(r.output_ids)) for r in plan.members],
            filters=[r.filters for r in plan.members], steering=[r.steering for r in plan.members],
            source=source.float().clone(), target=target.float().clone(), prediction=prediction.clone(),
            errors=ctx.errors.clone(),
            losses=dict(zip(plan.loss_groups, ctx.losses.tolist())) if ctx.losses is not None else {})
        return out

    def take_distiller_logits(self, d):
        super().take_distiller_logits(d)
        if getattr(self, "_trace", None) is not None:
            self._trace["distiller_logits"] = d.float().clone()

    def apply(self, logits):
        trace, self._trace = getattr(self, "_trace", None), None
        plan = self.plan(logits.shape[0]) if self.rows else None
        raw = None
        if trace is not None and plan is not None and plan.steered is not None:
            raw = logits.clone() if plan.idx is None else logits.index_select(0, plan.idx).clone()
        out = super().apply(logits)
        if raw is not None:
            steered = out if plan.idx is None else out.index_select(0, plan.idx)
            self.traces.append(dict(trace, logits=raw, steered=steered.clone()))
        return out
