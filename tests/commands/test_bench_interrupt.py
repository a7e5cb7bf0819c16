"""A bench stopped by its time limit still reports every workload: ``esamp bench`` with its engines
scripted and its clock one millisecond a step, stopped by a real SIGINT or SIGTERM sent to this
process at chosen points (as ``timeout -s INT`` sends it, copy included), then its table and JSON
read back. No vLLM, no GPU."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from esamp.core.config import EsampConfig, SamplingConfig

bench_run = importlib.import_module("esamp.commands.bench.run")  # the package exports a function of that name
trials_mod = importlib.import_module("esamp.commands.bench.trials")
stop_mod = importlib.import_module("esamp.commands.bench.stop")
ROOT = Path(__file__).resolve().parents[2]  # the repository, so a child process imports this checkout's esamp

FIRST, SECOND = ("default", (2, 1, 24)), ("default", (1, 1, 32))  # warm-ups of 16 tokens: timed passes stand out


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def process_time(self) -> float:
        return self.now / 2


class Engine:
    """Runs every request in one step of 1 ms on the bench's clock (2 ms for the timed passes that
    ``slow`` names); ``script(side, tokens, pass number)`` is called at the start of each pass,
    numbered per token budget, and may send this process a signal."""

    model_name = "scripted"

    def __init__(self, side: str, clock: Clock, script, slow=()) -> None:
        self.side, self.clock, self.script, self.slow = side, clock, script, set(slow)
        self.passes: Counter = Counter()
        self.pending: list[int] = []
        # the last fetch's (an interrupt asks nothing)
        self.counters = {"replay_host_ms": 3.0, "replay_steps": 10, "rebuild_host_ms": 4.0, "rebuild_steps": 2}
        self.counters["replay_cpu_ms"] = 1.0
        self.closed = False
        self.current = (0, 0)

    def start(self, prompt, sampling, steering):
        if not self.pending:
            self.passes[sampling.max_tokens] += 1
            self.current = (sampling.max_tokens, self.passes[sampling.max_tokens])
            self.script(self.side, *self.current)
        self.pending.append(sampling.n * sampling.max_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self):
        self.clock.now += 2e-3 if self.current in self.slow else 1e-3
        done = [SimpleNamespace(type="done", tokens=t) for t in self.pending]
        self.pending = []
        return [SimpleNamespace(type="step", port_hits=1, loss=0.5, candidates=2.0), *done]

    def drain(self) -> dict:
        return {"counters": self.counters}

    def close(self) -> None:
        self.closed = True


def _stop_at(side: str, tokens: int, number: int, sig=signal.SIGINT):
    """A script that sends ``sig`` when ``side`` starts its pass ``number`` of ``tokens`` tokens."""

    def script(s, t, k):
        if (s, t, k) == (side, tokens, number):
            os.kill(os.getpid(), sig)

    return script


def _never(side, tokens, number):
    pass


@pytest.fixture
def bench(monkeypatch, tmp_path, capsys):
    """Runs ``esamp bench``'s measuring and reporting (``_bench``) on scripted engines; returns
    (exit status, the JSON, the printed text, the engines)."""
    clock = Clock()
    monkeypatch.setattr(trials_mod, "time", clock)
    monkeypatch.setattr(bench_run.provenance, "commit", lambda: "0" * 40)
    monkeypatch.setattr(bench_run.provenance, "device", lambda: "scripted")
    monkeypatch.setattr(bench_run.provenance, "versions", lambda: {"vllm": "-", "torch": "-"})

    def go(script=_never, slow=(), workloads=(FIRST, SECOND), spread=0.03):
        plan = bench_run.Plan(
            workloads=list(workloads),
            trials=3,
            model=None,
            logits=["flat"],
            sampling=SamplingConfig(),
            esamp=EsampConfig(),
            given_filters={},
            given_beta=None,
            share=0.42,
            spread=spread,
            max_seqs=2,
            path=tmp_path / "bench.json",
        )
        args = SimpleNamespace(prompt_len=4, min_trial_seconds=0.0, eager=False, tensor_parallel_size=1)
        engines = {"baseline": Engine("baseline", clock, script), "esamp": Engine("esamp", clock, script, slow)}
        loaded: list = []

        def start(loads):
            loaded.extend(engines.values())
            loads.update(baseline=0.1, esamp=0.1)
            return [("baseline", engines["baseline"], False), ("esamp", engines["esamp"], True)]

        status = bench_run._bench(args, plan, start, loaded, tmp_path / "bench.vllm.log")
        assert signal.getsignal(signal.SIGINT) is previous_int  # handlers put back
        assert signal.getsignal(signal.SIGTERM) is previous_term
        assert not list(tmp_path.glob("*.partial"))
        return status, json.loads(Path(plan.path).read_text()), capsys.readouterr().out, engines

    # a SIGTERM the bench did not take would end the test run: fail the test instead
    def term(signum, frame):
        raise AssertionError("SIGTERM reached the test")

    previous_term = term
    # as the run found it: Python's default, or SIG_IGN where the suite runs in a shell's background
    previous_int = signal.getsignal(signal.SIGINT)
    saved = signal.signal(signal.SIGTERM, term)
    try:
        yield go
    finally:
        signal.signal(signal.SIGTERM, saved)


def _table(out: str) -> str:
    """The printed table: from its header to the device line (the trial lines come before it)."""
    return out[out.index("baseline tok/s") : out.index("device: ")]


def _line(out: str, workload: str) -> str:
    """The table's row of ``workload``."""
    (line,) = [line for line in _table(out).splitlines()[1:] if line.split()[1:2] == [workload]]
    return line


def test_an_uninterrupted_bench_reports_every_workload_complete(bench, monkeypatch):
    # the environment's switches are part of what was measured: recorded, less paths and secrets
    monkeypatch.setenv("ESAMP_UPDATE", "inline")
    monkeypatch.setenv("ESAMP_CACHE_DIR", "/some/where")
    monkeypatch.setenv("ESAMP_API_KEY", "do-not-write")
    status, report, out, engines = bench()
    assert report["environment"]["ESAMP_UPDATE"] == "inline"
    assert "ESAMP_CACHE_DIR" not in report["environment"] and "ESAMP_API_KEY" not in report["environment"]
    assert status == 0 and report["interrupted"] is False and report["signal"] is None
    assert [r["workload"] for r in report["workloads"]] == ["2x24", "1x32"]
    for r in report["workloads"]:
        assert (r["measured"], r["complete"], r["rounds_finished"], r["trials_finished"]) == (True, True, 1, 3)
        assert "interrupted" not in r and r["ratio_median"] == 1.0
    assert "cut" not in _table(out) and "interrupted" not in _table(out)
    assert all(e.closed for e in engines.values())


def test_a_cut_in_the_first_workloads_first_round_reports_its_finished_trials(bench, monkeypatch):
    """timeout's signal arrives twice (the bench, then its process group): the copy lands while
    the first is being handled and changes nothing."""
    copies = []

    def say(text):
        print(text, flush=True)
        if text.startswith("interrupted") and not copies:
            copies.append(text)
            os.kill(os.getpid(), signal.SIGINT)  # timeout's second copy

    monkeypatch.setattr(bench_run, "_say", say)
    # trial 0 (baseline, esamp) finishes; trial 1 starts with the esamp side and is cut
    status, report, out, engines = bench(_stop_at("esamp", 24, 2))
    assert copies and status == 130
    assert report["interrupted"] is True and report["signal"] == "SIGINT"
    first, second = report["workloads"]
    assert first["workload"] == "2x24" and first["measured"] is True and first["complete"] is False
    assert first["interrupted"] is True and first["trials_finished"] == 1 and first["rounds_finished"] == 0
    assert first["reported_round"] == 1 and first["rounds_started"] == 1
    assert first["ratio_median"] == first["ratio_min"] == first["ratio_max"] == 1.0
    assert {(t["trial"], t["side"]) for t in first["trials"]} == {(0, "baseline"), (0, "esamp")}
    assert second["workload"] == "1x32" and second["measured"] is False and second["reached"] is False
    assert report["esamp_counters"] == engines["esamp"].counters and report["peak_memory_bytes"] == {}
    row = _line(out, "2x24")
    assert row.endswith("  cut") and " 1.000 " in row
    assert "cut in round 1 (1 pass a trial) after 1 of 3 trials" in out
    assert "not measured (not reached)" in _line(out, "1x32")
    assert "(interrupted by SIGINT: every workload is listed" in out
    assert all(e.closed for e in engines.values())


def test_a_cut_in_a_spread_round_of_the_second_workload_reports_both(bench):
    """The second workload's first round spreads past ±3% (one slow ESamp pass), so it runs again
    with two passes a trial; SIGTERM cuts that round after its first trial."""
    # esamp's 32-token passes: round 1 = 1, 2, 3; round 2 = 4 5 (trial 0), 6 7 (trial 1), ...
    status, report, out, _ = bench(_stop_at("esamp", 32, 6, signal.SIGTERM), slow=[(32, 2)])
    assert status == 143 and report["signal"] == "SIGTERM" and report["interrupted"] is True
    first, second = report["workloads"]
    assert first["complete"] is True and first["trials_finished"] == 3 and "interrupted" not in first
    assert second["measured"] is True and second["complete"] is False and second["interrupted"] is True
    assert (second["reported_round"], second["rounds_started"], second["rounds_finished"]) == (2, 2, 1)
    assert second["rounds"] == 2 and second["trials_finished"] == 1 and second["ratio_median"] == 1.0
    assert [e["rounds"] for e in second["earlier"]] == [1] and second["earlier"][0]["spread"] > 0.03
    assert "cut" not in _line(out, "2x24")
    assert _line(out, "1x32").endswith("  cut") and "cut in round 2 (2 passes a trial) after 1 of 3 trials" in out


def test_a_cut_before_the_longer_round_finishes_a_trial_reports_the_last_whole_round(bench):
    status, report, out, _ = bench(_stop_at("esamp", 32, 4), slow=[(32, 2)])
    second = report["workloads"][1]
    assert status == 130 and second["measured"] is True and second["complete"] is False
    assert (second["reported_round"], second["rounds_started"], second["rounds_finished"]) == (1, 2, 1)
    assert second["trials_finished"] == 3 and second["within_target"] is False and second["earlier"] == []
    assert "round 1 (1 pass a trial), whole; cut in round 2 before a trial finished on every side" in out
    assert "cut before longer passes (1x32)" in out


def test_a_cut_after_every_workload_keeps_them_all_complete(bench, monkeypatch):
    """The signal comes while the engines are asked for their report (their peak memory): every
    workload finished, the bench is still marked interrupted and asks the engines nothing more."""

    def peak(engine):
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(bench_run, "_peak_memory", peak)
    status, report, out, engines = bench()
    assert status == 130 and report["interrupted"] is True and report["peak_memory_bytes"] == {}
    assert [(r["workload"], r["complete"], r["trials_finished"]) for r in report["workloads"]] == [
        ("2x24", True, 3),
        ("1x32", True, 3),
    ]
    assert report["host_ms_per_steady_step"] == 0.3  # the last fetch's counters
    assert report["host_ms_per_rebuild_step"] == 2.0  # a step whose batch changed, apart
    assert report["host_cpu_ms_per_steady_step"] == 0.1 and "the engine thread's CPU time: 0.1 ms" in out
    assert "a step whose batch changed (its plan built): 2.0 ms" in out
    assert "cut" not in _table(out) and "(interrupted by SIGINT after every workload finished)" in out


def test_a_cut_between_two_sides_records_of_a_trial_leaves_that_trial_out(bench, monkeypatch):
    """Trial 1 runs the ESamp side first: a signal while its line prints (its record kept, the
    baseline's not yet) reports trial 0 alone (the bench once failed here with a KeyError and
    wrote nothing)."""

    def say(text):
        print(text, flush=True)
        if "2x24 trial 1    esamp" in text:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(bench_run, "_say", say)
    status, report, out, _ = bench()
    first = report["workloads"][0]
    assert status == 130 and first["trials_finished"] == 1 and {t["trial"] for t in first["trials"]} == {0}


def test_a_cut_in_a_warm_up_lists_the_workload_as_not_measured(bench):
    status, report, out, _ = bench(_stop_at("baseline", 16, 2))  # the second workload's warm-up
    first, second = report["workloads"]
    assert status == 130 and first["complete"] is True
    assert (second["measured"], second["reached"], second["rounds_started"]) == (False, True, 0)
    assert "not measured (cut before a trial finished on every side)" in _line(out, "1x32")


def test_an_error_that_the_signal_caused_reads_as_the_interruption(bench):
    """An interrupt inside a lock's wait can come out as another error (``RuntimeError: release
    unlocked lock``, from vLLM's output queue); after a stop signal it is the stop."""

    def script(side, tokens, number):
        if (side, tokens, number) == ("baseline", 24, 3):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):
                    pass
            except KeyboardInterrupt:
                raise RuntimeError("release unlocked lock") from None

    status, report, out, _ = bench(script)
    assert status == 130 and report["interrupted"] is True
    assert "interrupted (SIGINT; RuntimeError on the way out)" in out
    assert report["workloads"][0]["trials_finished"] == 2


def test_a_failure_without_a_signal_is_no_interruption(bench, tmp_path):
    def script(side, tokens, number):
        if (side, tokens, number) == ("esamp", 24, 2):
            raise RuntimeError("the engine core died")

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError, match="engine core died"):
        bench(script)
    assert not (tmp_path / "bench.json").exists()
    assert signal.getsignal(signal.SIGINT) is before  # put back


def test_a_second_signal_after_the_grace_leaves_at_once(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(stop_mod, "time", SimpleNamespace(monotonic=lambda: now[0]))
    stop = stop_mod.StopSignals()
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)
    stop.hold()
    stop._handle(signal.SIGINT, None)  # timeout's copy: absorbed
    now[0] += stop_mod.GRACE_SECONDS + 0.5
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)  # asked again
    assert stop.status == 130 and stop.name == "SIGINT"
    held = stop_mod.StopSignals()
    held.hold()
    held._handle(signal.SIGTERM, None)  # while the report is written: remembered, not raised
    assert held.status == 143


def test_leaving_at_once_waits_out_the_grace_of_the_first_signal(monkeypatch):
    """The report is written sooner than timeout's copy of the signal may come on a busy machine:
    until the grace is over the handler that absorbs the copy stays, and only then does a further
    signal end the bench at once."""
    now, slept, seen = [100.0], [], []

    def sleep(seconds):
        seen.append(signal.getsignal(signal.SIGINT))  # what a copy arriving now would meet
        slept.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(stop_mod, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    before = signal.getsignal(signal.SIGINT)
    stop = stop_mod.StopSignals().install()
    try:
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGINT, None)
        stop.hold()
        now[0] += 0.25  # the report took a quarter of a second
        stop.leave_at_once()
        assert slept == [pytest.approx(stop_mod.GRACE_SECONDS - 0.25)] and seen == [stop._handle]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
        late = stop_mod.StopSignals().install()
        with pytest.raises(KeyboardInterrupt):
            late._handle(signal.SIGTERM, None)
        now[0] += stop_mod.GRACE_SECONDS + 1  # a slow report: nothing left to wait for
        late.leave_at_once()
        assert len(slept) == 1
        late.restore()
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before


# ``esamp bench`` in a process of its own under ``timeout -s INT``, as the GPU suite runs it: its
# engines scripted (a pass of L tokens sleeps L/10 ms), the first workload short, the second far
# longer than it takes to cut, the third never reached. The test chooses the moment: timeout relays
# a SIGINT it gets as it sends its own when time is up (to the bench, then to its process group),
# so the bench sees the same two signals. Timeout's own clock (3 s, once) also counted Python's
# start and imports: the first workload ended 0.9-1.7 s after the start with two busy loops on two
# cores, and with six, 2 runs in 10 got the signal before the bench had begun (no bench.json).
UNDER_TIMEOUT = """
import importlib, sys, time
from pathlib import Path
from types import SimpleNamespace
from esamp.commands import cli
from esamp.core.config import EsampConfig, SamplingConfig

bench_run = importlib.import_module("esamp.commands.bench.run")
bench_run.provenance.versions = lambda: {"vllm": "-", "torch": "-"}
bench_run.provenance.device = lambda: "scripted"
bench_run.provenance.commit = lambda: None

class Engine:
    model_name = "scripted"
    counters = {}

    def __init__(self):
        self.pending = []

    def start(self, prompt, sampling, steering):
        self.pending.append(sampling.max_tokens)

    def has_unfinished(self):
        return bool(self.pending)

    def step(self):
        time.sleep(sum(self.pending) / 1e4)
        done = [SimpleNamespace(type="done", tokens=t) for t in self.pending]
        self.pending = []
        return [SimpleNamespace(type="step", port_hits=1, loss=0.5, candidates=2.0), *done]

    def drain(self):
        return {}

    def close(self):
        pass

def plan(args):
    return bench_run.Plan(workloads=[("default", (1, 1, 4)), ("default", (1, 1, 400)), ("default", (1, 1, 8))],
                          trials=40, model=None, logits=["flat"], sampling=SamplingConfig(), esamp=EsampConfig(),
                          given_filters={}, given_beta=None, share=0.42, max_seqs=1, spread=0.0,
                          path=Path("bench.json"))

def measure(args, plan, loaded, log):
    args.prompt_len, args.min_trial_seconds, args.eager, args.tensor_parallel_size = 4, 0.0, False, 1

    def start(loads):
        loaded.extend([Engine(), Engine()])
        return [("baseline", loaded[0], False), ("esamp", loaded[1], True)]

    return bench_run._bench(args, plan, start, loaded, log)

bench_run._plan, bench_run._measure = plan, measure
sys.exit(cli.main(["bench"]))
"""


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")
def test_a_bench_cut_by_timeout_writes_every_workload(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(tmp_path / "stderr.txt", "w+") as err:  # a file: a full stderr pipe cannot stall the bench
        proc = subprocess.Popen(
            # (timeout's own clock only bounds a bench that hangs: INT at 120 s, KILL 60 s after a signal)
            ["timeout", "--preserve-status", "-k", "60", "-s", "INT", "120", sys.executable, "-c", UNDER_TIMEOUT],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        try:
            out = ""
            # the second workload's trial 0 has finished on both sides: cut it there
            while "1x400 trial 1 " not in out:
                line = proc.stdout.readline()
                assert line, f"the bench ended before its second workload's trial 1:\n{out[-2000:]}"
                out += line
            proc.send_signal(signal.SIGINT)  # to timeout, which sends it on as when time is up
            out += proc.stdout.read()  # the same file object: nothing it has buffered is lost
            proc.wait(60)
        finally:
            if proc.poll() is None:  # a failed test: timeout leads a process group of its own
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        err.seek(0)
        assert proc.returncode == 130, out[-2000:] + err.read()[-2000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["interrupted"] is True and report["signal"] == "SIGINT"
    first, second, third = report["workloads"]
    assert first["workload"] == "1x4" and first["complete"] is True and first["trials_finished"] == 40
    assert second["workload"] == "1x400" and second["complete"] is False
    assert second["measured"] is True and 1 <= second["trials_finished"] < 40
    assert third["workload"] == "1x8" and third["measured"] is False and third["reached"] is False
    table = _table(out)
    assert "1x4" in table and "1x400" in table and "not measured (not reached)" in table
