"""The tests' steering: ``EngineSteering`` that records what every steered step saw and did.

Apart from ``_tracing`` (whose adapters need vLLM) so that a check without vLLM, in Triton's
interpreter, steps it too (``test_padded_step.check_one_graph_step``).
"""

from __future__ import annotations

from esamp.core.intervention import dense_logits
from esamp.engines.vllm.steering import EngineSteering


class TracingSteering(EngineSteering):
    traces: list[dict] = []  # every steered step, oldest first (tests clear it)
    _trace: dict | None = None
    _raw: object = None  # the steered rows' logits before a one-graph step mixed them

    def distill(self, plan, source, target, normalize, head_dtype):
        handoff = super().distill(plan, source, target, normalize, head_dtype)
        self._trace = self._traced(plan, handoff, source, target, normalize)
        return handoff

    def _fused_step(self, plan, logits, taps):
        """Model Runner V2's one-graph step (the update in line): the Distiller step and the filter
        and mix in one replay, so the logits are taken before it and the taps after."""
        raw = logits.index_select(0, plan.step.index[: plan.steered]).clone()
        handoff = super()._fused_step(plan, logits, taps)
        if handoff is not None:
            self._trace, self._raw = self._traced(plan, handoff, *taps[:3]), raw
        return handoff

    def _traced(self, plan, handoff, source, target, normalize) -> dict:
        s, H = plan.steered, self.hidden
        taps = self._taps.index_select(0, plan.step.index[:s])
        x, y = taps[:, source * H : (source + 1) * H], taps[:, target * H : (target + 1) * H]
        if normalize is not None:
            x, y = normalize(x, y)
        losses = {}
        if handoff.losses is not None:
            losses = {g: v for owners, v in zip(plan.unit_groups, handoff.losses.tolist()) for g in owners}
        m = plan.members
        return dict(
            meta=[(r.group, r.sample) for r in m],  # with each row's generation index in ``apply``
            filters=[r.filters for r in m],
            steering=[r.steering for r in m],
            source=x.float().clone(),
            target=y.float().clone(),
            prediction=handoff.prediction[:s].float().clone(),
            errors=handoff.errors[:s].clone(),
            losses=losses,
            trains=plan.step.trains,
        )

    def apply(self, plan, logits, handoff, generated=None, *started):  # (the adapter's start times, passed on)
        trace, self._trace = self._trace, None
        raw, self._raw = self._raw, None
        index = plan.step.index[: plan.steered]
        if trace is not None and raw is None:
            raw = logits.index_select(0, index).clone()
        out = super().apply(plan, logits, handoff, generated, *started)
        if trace is not None and handoff is not None and handoff.d is not None:
            at = list(map(len, plan.outputs)) if generated is None else generated
            self.traces.append(
                dict(
                    trace,
                    meta=[(g, sample, k) for (g, sample), k in zip(trace["meta"], at)],
                    logits=raw,
                    steered=out.index_select(0, index).clone(),
                    distiller_logits=dense_logits(handoff.d, self.vocab).float().clone(),
                )
            )
        return out
