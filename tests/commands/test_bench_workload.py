"""Ctrl-C in the middle of ``esamp bench``: the trials that finished are kept in the report."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from esamp.core.config import EsampConfig, SamplingConfig

bench_run = importlib.import_module("esamp.commands.bench.run")  # the package exports a function of that name
trials_mod = importlib.import_module("esamp.commands.bench.trials")


class StepClock:
    """The trials' clock: one millisecond per engine step, so every pass takes the same time
    whatever the machine is doing (a real clock gave a ratio that rounded to 0 under load)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def process_time(self) -> float:
        return self.now / 2


class CountingEngine:
    """Finishes every request in one step; raises KeyboardInterrupt at the ``stop_at``-th start
    of any engine (the counter is shared)."""

    def __init__(self, starts: list[int], stop_at: int, clock: StepClock) -> None:
        self.starts, self.stop_at, self.pending, self.clock = starts, stop_at, [], clock

    def start(self, prompt, sampling, steering):
        self.starts[0] += 1
        if self.starts[0] == self.stop_at:
            raise KeyboardInterrupt
        self.pending.append(sampling.n * sampling.max_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self):
        self.clock.now += 1e-3
        done = [SimpleNamespace(type="done", tokens=t) for t in self.pending]
        self.pending = []
        return [SimpleNamespace(type="step", port_hits=1, loss=0.5, candidates=2.0), *done]

    def drain(self) -> dict:
        return {}


def _run(sides, shape, trials: int, results: list[dict], **kw) -> None:
    """``esamp bench``'s one workload (flat logits, the default preset) on these sides; its report
    row goes into ``results`` however it ends (the bench makes its rows when it writes the report)."""
    args = SimpleNamespace(prompt_len=4, min_trial_seconds=0.0)
    runs: list = []
    try:
        bench_run._workload(
            "flat",
            "default",
            shape,
            sides,
            {},
            None,
            SamplingConfig(seed=0),
            EsampConfig(),
            32_000,
            args,
            trials,
            runs,
            **kw,
        )
    finally:
        results[:] = [run.row() for run in runs]


def _measure(stop_at: int, monkeypatch) -> list[dict]:
    starts, clock = [0], StepClock()
    monkeypatch.setattr(trials_mod, "time", clock)
    sides = [
        (name, CountingEngine(starts, stop_at, clock), on)
        for name, on in (("baseline", False), ("floor", False), ("esamp", True))
    ]
    results: list[dict] = []
    with pytest.raises(KeyboardInterrupt):
        _run(sides, (2, 1, 8), 3, results)
    return results


def test_an_interrupted_workload_keeps_its_finished_trials(monkeypatch):
    # 2 prompts a pass, 3 sides: 6 starts warm up, 6 per trial; stop inside the third trial
    results = _measure(stop_at=6 + 2 * 6 + 3, monkeypatch=monkeypatch)
    (r,) = results
    assert r["interrupted"] is True and r["workload"] == "2x8"
    assert (r["complete"], r["reported_round"], r["rounds_finished"], r["trials_finished"]) == (False, 1, 0, 2)
    assert sorted({t["trial"] for t in r["trials"]}) == [0, 1]
    assert {t["side"] for t in r["trials"]} == {"baseline", "floor", "esamp"}
    assert r["ratio_min"] == r["ratio_max"] == 1.0 and r["floor_ratio_median"] == 1.0


def test_an_interrupt_before_any_trial_finished_lists_the_workload_as_not_measured(monkeypatch):
    (r,) = _measure(stop_at=6 + 2, monkeypatch=monkeypatch)
    assert r["workload"] == "2x8" and r["measured"] is False and r["reached"] is True
    assert (r["complete"], r["rounds_started"], r["rounds_finished"], r["trials_finished"]) == (False, 1, 0, 0)
    assert "ratio_median" not in r


def test_an_interrupted_bench_asks_the_engines_nothing_for_its_report():
    """Ctrl-C reaches vLLM's engine processes too; neither the counters nor the peak memory are
    asked of engines that may not answer (this hung a GPU run until the machine's time limit).
    The counters of the last fetch, kept by the client, are reported instead."""

    class Mute:
        counters = {"replay_host_ms": 12.0, "replay_steps": 40}  # the last fetch's, in the client

        def __getattr__(self, name):
            raise AssertionError(f"the engine was called ({name}) after an interrupt")

    steer = Mute()
    assert bench_run._engine_reports(steer, [("esamp", steer, True)], interrupted=True) == (Mute.counters, {})

    class Fresh(Mute):
        counters = None  # interrupted before any fetch

    steer = Fresh()
    assert bench_run._engine_reports(steer, [("esamp", steer, True)], interrupted=True) == ({}, {})


class NoisyEngine:
    """Every fourth timed pass of ``slow_side`` takes twice as long (something else on the machine):
    trials of one pass spread widely, trials of four passes do not spread at all."""

    def __init__(self, clock: StepClock, slow: bool, tokens: int) -> None:
        self.clock, self.slow, self.tokens, self.passes, self.pending = clock, slow, tokens, 0, []

    def start(self, prompt, sampling, steering):
        if not self.pending and sampling.max_tokens == self.tokens:
            self.passes += 1
        self.pending.append(sampling.n * sampling.max_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self):
        slow = self.slow and self.pending and self.passes % 4 == 0
        self.clock.now += 2e-3 if slow else 1e-3
        done = [SimpleNamespace(type="done", tokens=t) for t in self.pending]
        self.pending = []
        return [SimpleNamespace(type="step", port_hits=1, loss=0.5, candidates=2.0), *done]

    def drain(self) -> dict:
        return {}


def _noisy(monkeypatch, spread: float, stop_after: int | None = None) -> dict:
    clock = StepClock()
    monkeypatch.setattr(trials_mod, "time", clock)
    esamp = NoisyEngine(clock, True, 32)
    if stop_after is not None:  # Ctrl-C at the start of the esamp side's pass number stop_after
        start = esamp.start

        def stopping(prompt, sampling, steering):
            if not esamp.pending and sampling.max_tokens == 32 and esamp.passes + 1 == stop_after:
                raise KeyboardInterrupt
            start(prompt, sampling, steering)

        esamp.start = stopping
    sides = [("baseline", NoisyEngine(clock, False, 32), False), ("esamp", esamp, True)]
    results: list[dict] = []
    try:
        _run(sides, (1, 1, 32), 4, results, spread=spread)
    except KeyboardInterrupt:
        assert stop_after is not None
    (r,) = results
    return r


def test_trials_that_spread_past_the_target_run_again_with_longer_passes(monkeypatch):
    r = _noisy(monkeypatch, spread=0.03)
    assert [e["rounds"] for e in r["earlier"]] == [1, 2] and r["rounds"] == 4
    assert r["earlier"][0]["spread"] > 0.03 and r["spread"] == 0.0 and r["within_target"] is True
    assert r["ratio_min"] == r["ratio_max"] == 0.8  # four passes, one of them twice as long
    assert {t["rounds"] for t in r["trials"]} == {4}  # the report's trials are the trusted attempt's


def test_a_spread_target_of_zero_keeps_the_first_trials(monkeypatch):
    r = _noisy(monkeypatch, spread=0.0)
    assert r["rounds"] == 1 and r["earlier"] == [] and r["spread"] > 0.03 and r["within_target"] is True


def test_the_table_marks_ratios_that_stayed_wide(monkeypatch, capsys):
    monkeypatch.setattr(bench_run, "MAX_LENGTHENINGS", 0)
    r = _noisy(monkeypatch, spread=0.03)
    assert r["within_target"] is False
    bench_run._print_table(dict(workloads=[r], device="cpu", versions=dict(vllm="-", torch="-")))
    out = capsys.readouterr().out
    assert f"±{r['spread']:.1%}*" in out and "read them as a range" in out


def test_an_interrupt_before_the_longer_passes_finish_a_trial_keeps_the_last_whole_attempt(monkeypatch):
    # 4 trials of 1 pass (esamp passes 1-4), then the first pass of 2-pass trials is stopped
    r = _noisy(monkeypatch, spread=0.03, stop_after=5)
    assert r["interrupted"] is True and r["rounds"] == 1 and r["earlier"] == []
    assert len({t["trial"] for t in r["trials"]}) == 4 and r["within_target"] is False


class FetchingEngine(CountingEngine):
    """Like ``CountingEngine``, and every step fetches records the way the ESamp engine counts
    them (``drains``, ``drain_seconds``): ``fetch`` seconds each on the trials' clock, of a 1 ms step."""

    def __init__(self, clock: StepClock, fetch: float) -> None:
        super().__init__([0], 0, clock)
        self.fetch, self.drains, self.drain_seconds = fetch, 0, 0.0

    def step(self):
        if self.fetch:
            self.drains += 1
            self.drain_seconds += self.fetch
        return super().step()

    def drain(self) -> dict:  # the pass's closing fetch, outside its timed window
        self.drains += 1
        self.drain_seconds += 1.0
        return {}


def test_a_trial_of_several_passes_reports_its_record_fetches(monkeypatch, capsys):
    """Each pass counts the fetches of its timed window; the trial sums them, their share is
    their seconds over the passes' (the JSON's trials and the trial line show both)."""
    clock = StepClock()
    monkeypatch.setattr(trials_mod, "time", clock)
    sides = [("baseline", FetchingEngine(clock, 0.0), False), ("esamp", FetchingEngine(clock, 0.25e-3), True)]
    one = trials_mod.run_trial(sides[1][1], [[1, 2]], 1, 4, {}, None)
    assert (one["drains"], one["drain_seconds"], one["drain_share"]) == (1, 0.00025, 0.25)
    records = trials_mod.run_interleaved([(n, e, None) for n, e, _ in sides], [[1, 2]], 1, 4, {}, trials=2, rounds=3)
    for r in records:
        steered = r["side"] == "esamp"
        assert r["drains"] == (3 if steered else 0) and r["drain_share"] == (0.25 if steered else 0.0), r
        assert r["drain_seconds"] == pytest.approx(3 * 0.25e-3 if steered else 0.0)
    results: list[dict] = []
    _run(sides, (2, 1, 8), 2, results)
    (w,) = results
    esamp = [t for t in w["trials"] if t["side"] == "esamp"]
    assert esamp and all(t["drains"] == t["rounds"] and t["drain_share"] == 0.25 for t in esamp)
    out = capsys.readouterr().out
    assert "esamp:" in out and ", 1 record fetches 25% of it)" in out
    assert not [line for line in out.splitlines() if "baseline:" in line and "record fetches" in line]


def test_the_steady_steps_host_time_is_split_into_its_parts():
    """``host_split_per_steady_step``: ms a steady step for the Distiller step, the filter and mix,
    the record and the rest of the adapter's ``apply``; None before any steady step or from an
    engine that does not split (older counters)."""
    counters = {
        "replay_steps": 40,
        "replay_host_ms": 12.0,
        "replay_distill_ms": 4.0,
        "replay_mix_ms": 2.0,
        "replay_records_ms": 1.0,
    }
    assert bench_run.steady_split(counters) == {"distill": 0.1, "mix": 0.05, "records": 0.025, "rest": 0.125}
    assert bench_run.steady_split({**counters, "replay_steps": 0}) is None
    assert bench_run.steady_split({"replay_steps": 40, "replay_host_ms": 12.0}) is None


class RecordsTailEngine(CountingEngine):
    """vLLM's last outputs come at a pass's first step (``last_output_at``); its groups end
    ``tail_steps`` steps later, as an ESamp engine's end once their last records are back."""

    def __init__(self, clock: StepClock, tail_steps: int, first_token_s: float = 0.002) -> None:
        super().__init__([0], 0, clock)
        self.tail_steps, self.waited, self.last_output_at = tail_steps, 0, None
        self.first_token_s, self.first_token_seconds = first_token_s, []

    def step(self):
        self.clock.now += 1e-3
        if self.waited == 0:
            self.last_output_at = self.clock.now
            self.first_token_seconds.append(self.first_token_s)
        if self.waited < self.tail_steps:
            self.waited += 1
            return []
        self.waited = 0
        done = [SimpleNamespace(type="done", tokens=t) for t in self.pending]
        self.pending = []
        return done


def test_a_pass_reports_its_tail_from_the_last_outputs_to_its_end(monkeypatch):
    """``run_trial``'s ``tail_ms``: from the engine step that brought vLLM's last outputs to the
    pass's end (the ESamp engine waits there for its last records); none for an engine that does
    not say when its outputs came. The workload's row has each side's median."""
    clock = StepClock()
    monkeypatch.setattr(trials_mod, "time", clock)
    sampling = {"temperature": 0.8}
    ended = RecordsTailEngine(clock, tail_steps=2)
    r = trials_mod.run_trial(ended, [[1, 2]], 1, 4, sampling, None)
    assert r["tail_ms"] == pytest.approx(2.0)
    r = trials_mod.run_trial(CountingEngine([0], 0, clock), [[1, 2]], 1, 4, sampling, None)
    assert r["tail_ms"] is None
    assert trials_mod.combine([r])["tail_ms_median"] is None
    results: list[dict] = []
    sides = [("baseline", RecordsTailEngine(clock, 0), False), ("esamp", RecordsTailEngine(clock, 3, 0.003), True)]
    _run(sides, (2, 1, 8), 2, results)
    (row,) = results
    assert row["tail_ms_baseline"] == pytest.approx(0.0) and row["tail_ms_esamp"] == pytest.approx(3.0)
    assert (row["ttft_ms_baseline"], row["ttft_ms_esamp"], row["ttft_ratio"]) == (2.0, 3.0, 1.5)
    assert all(t["tail_share"] is not None for t in row["trials"])
