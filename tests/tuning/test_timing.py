"""Interleaved timing rounds (``deploykit.tuning.timing``), as bench and tune use them, with fake
steps on the CPU: each step logs its calls and, under a fake timer, says how long it "took"."""

from __future__ import annotations

import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from deploykit.tools import bench
from deploykit.tuning import timing, tune
from deploykit.tuning.candidates import Candidate
from deploykit.tuning.timing import Budget, calls_per_round, interleave, round_order, summarize
from deploykit_cli import run_deploykit

SPECS = [{"name": "x", "shape": ["batch", 3], "dtype": "float32"}]


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_rounds_below_one_is_a_usage_error(tmp_path, command):
    result = run_deploykit(command, tmp_path, "--rounds", "0", "--device", "cpu")
    assert result.returncode == 2 and "--rounds" in result.stderr


@pytest.fixture
def fake_clock(monkeypatch):
    """Each timed call takes what the step returns (seconds), whatever the host clock says."""
    monkeypatch.setattr(timing, "call_timer", lambda device: lambda step: step())


def logging_step(name: str, log: list, seconds=lambda call: 1e-3):
    """A step that appends ``name`` to ``log`` and returns ``seconds(its call number)``."""
    calls = []

    def step():
        calls.append(None)
        log.append(name)
        return seconds(len(calls))

    return step


def test_iterations_are_shared_out_over_the_rounds():
    assert calls_per_round(Budget(iterations=12, rounds=5)) == [3, 3, 2, 2, 2]
    assert calls_per_round(Budget(iterations=3, rounds=5)) == [1, 1, 1]  # no empty rounds
    assert calls_per_round(Budget(iterations=7, rounds=1)) == [7]


def test_the_order_rotates_so_each_step_is_first_and_last_in_turn():
    orders = [round_order(3, index, 3) for index in range(3)]
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    spread = [round_order(10, index, 5) for index in range(5)]
    assert [order[0] for order in spread] == [0, 2, 4, 6, 8] and all(sorted(o) == list(range(10)) for o in spread)


def test_rounds_interleave_after_every_step_is_warmed_up(fake_clock):
    log = []
    steps = [logging_step(name, log) for name in "abc"]
    timed = interleave(steps, Budget(warmup=1, iterations=6, rounds=3))
    assert "".join(log) == "abc" + "aabbcc" + "bbccaa" + "ccaabb"
    assert all(len(t.rounds) == 3 and all(len(r) == 2 for r in t.rounds) and t.error is None for t in timed)


def test_p50_is_the_median_of_the_round_medians():
    rounds = [[0.001, 0.002, 0.003], [0.010, 0.010, 0.011], [0.002, 0.002, 0.002]]  # one slow round
    result = summarize(rounds, batch=4)
    assert result["round_p50_ms"] == pytest.approx([2.0, 10.0, 2.0])
    assert result["p50_ms"] == pytest.approx(2.0) and result["spread"] == pytest.approx(4.0)
    everything = np.concatenate(rounds) * 1e3
    assert result["p99_ms"] == pytest.approx(np.percentile(everything, 99))
    assert (result["iterations"], result["rounds"]) == (9, 3)
    assert result["throughput"] == pytest.approx(4 / (everything.mean() / 1e3))


def test_drift_during_the_run_falls_on_every_step_alike(fake_clock):
    """Every call gets slower as the run goes on: timed one after another, the last step would look
    slowest; timed in rotated rounds, identical steps come out close."""
    log = []

    def drifting(call):  # by the run's call count, not the step's
        return 1e-3 * (1 + len(log) / 100)

    steps = [logging_step(name, log, drifting) for name in "abcde"]
    p50 = [summarize(t.rounds, 1)["p50_ms"] for t in interleave(steps, Budget(warmup=0, iterations=50, rounds=5))]
    assert max(p50) / min(p50) < 1.2  # one block each would give 3.25 / 1.25 = 2.6


def test_max_seconds_bounds_each_steps_time_and_every_round_gets_a_call():
    slow, quick = (lambda: time.sleep(0.02)), (lambda: None)
    budget = Budget(warmup=0, iterations=10_000, max_seconds=0.2, rounds=2)
    started = time.perf_counter()
    timed = interleave([slow, quick], budget)
    assert time.perf_counter() - started < 5
    for result in timed:
        assert len(result.rounds) == 2 and all(result.rounds)
        for times in result.rounds:  # the last call starts before its round's share runs out
            assert sum(times[:-1]) <= budget.max_seconds / budget.rounds
    assert sum(map(len, timed[0].rounds)) < 30


def test_a_step_that_breaks_is_dropped_and_the_others_go_on(fake_clock):
    log = []

    def breaks_on_third_call(call):
        if call == 3:
            raise RuntimeError("device lost")
        return 1e-3

    def breaks_in_warm_up():
        raise ValueError("no kernel")

    steps = [logging_step("a", log), logging_step("b", log, breaks_on_third_call), breaks_in_warm_up]
    good, broken, cold = interleave(steps, Budget(warmup=1, iterations=6, rounds=3))
    assert len(good.rounds) == 3 and good.error is None and log.count("a") == 7
    assert isinstance(broken.error, RuntimeError) and broken.rounds == [] and log.count("b") == 3
    assert isinstance(cold.error, ValueError) and cold.rounds == []
    assert interleave([], Budget()) == []


# --------------------------------------------------------------------------- bench


class Backend:
    """A fake backend: made by a contender's setup for one batch size, logs its calls."""

    alive: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, key: str, log: list):
        self.key, self.log = key, log
        Backend.alive.add(self)

    def step(self):
        self.log.append(self.key)
        time.sleep(1e-4)


def fake_contender(key: str, log: list, setups: list, broken_at: int | None = None) -> bench.Contender:
    def setup(notes):
        setups.append((key, {b.key for b in Backend.alive}))  # what is alive when this one is built
        backend = Backend(key, log)

        def prepare(feeds):
            if next(iter(feeds.values())).shape[0] == broken_at:
                raise RuntimeError("out of memory")
            return backend.step

        return prepare

    return bench.Contender(key, key, setup)


def test_bench_times_contenders_side_by_side_and_frees_them_between_batch_sizes():
    log, setups = [], []
    found = [fake_contender(key, log, setups) for key in ("pytorch", "reduce-overhead", "deploykit-load")]
    found += [fake_contender("ort-plain", log, setups, broken_at=4), bench.Contender("tensorrt", "TensorRT",
                                                                                       reason="GPU only")]
    settings = bench.Settings([1, 4], warmup=1, iterations=6, rounds=3)
    ticks = []
    result = bench.run_benchmark(SimpleNamespace(path=Path("fake"), inputs=SPECS), settings, found, ticks.append)
    assert len(ticks) == bench.progress_steps(settings, found) == 2 * (4 + 3)
    assert [alive for _, alive in setups[:4]] == [set(), {"pytorch"}, {"pytorch", "reduce-overhead"},
                                                   {"pytorch", "reduce-overhead", "deploykit-load"}]
    assert setups[4] == ("pytorch", set())  # batch 1's backends are gone before batch 4's are built
    first_round = log[8:16]  # after each one's first call and warm-up call
    assert first_round == ["pytorch"] * 2 + ["reduce-overhead"] * 2 + ["deploykit-load"] * 2 + ["ort-plain"] * 2
    assert log[16:18] == ["reduce-overhead"] * 2  # the next round starts with the next contender
    entries = {entry["key"]: entry for entry in result["contenders"]}
    for key in ("pytorch", "reduce-overhead", "deploykit-load"):
        assert entries[key]["status"] == "ok" and entries[key]["reason"] == ""
        assert [r["batch"] for r in entries[key]["results"]] == [1, 4]
        for row in entries[key]["results"]:
            assert row["iterations"] == 6 and row["rounds"] == 3 and len(row["round_p50_ms"]) == 3
            assert min(row["round_p50_ms"]) <= row["p50_ms"] <= max(row["round_p50_ms"]) and row["spread"] >= 0
            assert row["setup_s"] >= 0 and row["first_call_s"] >= 0 and row["vs_reduce_overhead"] > 0
    broken = entries["ort-plain"]
    assert broken["status"] == "failed" and broken["reason"] == "batch 4: out of memory"
    assert [r["batch"] for r in broken["results"]] == [1]
    assert entries["tensorrt"] == {"key": "tensorrt", "label": "TensorRT", "precision": "fp32", "status": "skipped",
                                   "reason": "GPU only", "notes": [], "results": []}


# --------------------------------------------------------------------------- tune


class FakeRunner:
    """What tune opens: logs its calls; ``opened`` holds the runners not yet closed."""

    opened: list = []

    def __init__(self, label: str, log: list):
        self.label, self.log = label, log
        FakeRunner.opened.append(self)

    def run(self, feeds):
        self.log.append(self.label)

    def close(self):
        FakeRunner.opened.remove(self)


def test_tune_opens_every_candidate_per_batch_size_and_times_them_interleaved(monkeypatch, fake_clock):
    log, open_at = [], []
    found = [Candidate("onnxruntime", {}, "first"), Candidate("onnxruntime", {"cuda_graph": True}, "second"),
             Candidate("tensorrt", {"file": "x.engine"}, "broken"), Candidate("aoti", {}, "static", batch=[(2, 2)])]

    def open_runner(bundle, backend, options, *args, **kwargs):
        label = next(c.label for c in found if (c.backend, c.options) == (backend, options))
        open_at.append((label, [r.label for r in FakeRunner.opened]))
        if label == "broken":
            raise RuntimeError("engine for another GPU")
        return FakeRunner(label, log)

    monkeypatch.setattr(tune, "open_runner", open_runner)
    monkeypatch.setattr(tune, "check", lambda *args: {"passed": True, "max_abs": 0.0, "failures": []})
    monkeypatch.setattr(tune, "_step", lambda runner, feeds, backend, settings: lambda: (runner.run(feeds), 1e-3)[1])
    settings = tune.TuneSettings(warmup=0, iterations=4, rounds=2)
    columns = [tune.time_batch(found, None, None, {"x": np.zeros((batch, 3))}, settings) for batch in (1, 2)]
    assert open_at[:3] == [("first", []), ("second", ["first"]), ("broken", ["first", "second"])]
    assert open_at[3] == ("first", []) and FakeRunner.opened == []  # closed after each batch size
    one, two = ({r["label"]: r for r in column} for column in columns)
    assert log[:2 + 2] == ["first", "second"] + ["first"] * 2  # first calls, then round one: first's 2 calls
    assert one["first"]["p50_ms"] == pytest.approx(1.0) and one["first"]["spread"] == 0
    assert one["broken"]["p50_ms"] is None and one["broken"]["reason"] == "engine for another GPU"
    assert one["static"]["p50_ms"] is None and one["static"]["reason"] == "it takes batch sizes 2"
    assert two["static"]["p50_ms"] == pytest.approx(1.0) and two["second"]["passed"]


def test_each_contender_is_put_against_reduce_overhead_in_the_precision_pytorch_computes_it_in():
    """fp8 bundles against PyTorch fp16, int8 against fp32 (bench.PYTORCH_PRECISION); fp16 against fp16."""
    def entry(key, precision, ms):
        return {"key": key, "precision": precision, "results": [{"batch": 8, "p50_ms": ms}]}

    entries = [entry("reduce-overhead", "fp32", 4.0), entry("reduce-overhead-fp16", "fp16", 2.0),
               entry("aoti-static", "fp8", 1.5), entry("ort-deploykit", "int8", 3.0), entry("tensorrt", "fp16", 1.0)]
    bench.add_ratios(entries)
    ratios = {e["key"]: e["results"][0]["vs_reduce_overhead"] for e in entries}
    assert ratios == {"reduce-overhead": 1.0, "reduce-overhead-fp16": 1.0, "aoti-static": 0.75,
                      "ort-deploykit": 0.75, "tensorrt": 0.5}
    assert entries[2]["results"][0]["vs_fastest"] == 1.5
