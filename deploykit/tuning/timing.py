"""How deploykit times one inference, shared by ``bench`` and ``tune`` so their numbers mean the same.

A contender is a zero-argument step that runs one inference to completion. On a GPU every step
runs on one non-default stream (ONNX Runtime is handed it as its ``user_compute_stream``) and each
call is timed by CUDA events recorded on that stream before and after it: the latency of one
synchronous inference, launch gaps included. On the CPU the host clock is read around each call.

Steps are timed side by side, not one after another: all are set up, warmed up, then timed in
rounds that each time every step in turn (:func:`interleave`), and a step's p50 is the median of
its rounds' medians (:func:`summarize`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable

import numpy as np

Step = Callable[[], object]

TIMING = {"cpu": "host clock around each call",
          "cuda": "CUDA events on the bench stream before and after each synchronous call"}


@dataclasses.dataclass
class Budget:
    """How long to time steps side by side: ``warmup`` untimed calls each, then ``rounds`` rounds
    that share out ``iterations`` calls and ``max_seconds`` per step (see :func:`interleave`)."""

    device: str = "cpu"
    warmup: int = 10
    iterations: int = 100
    max_seconds: float = 20.0
    rounds: int = 5


@dataclasses.dataclass
class Timed:
    """One step's call times in seconds, round by round, or the error that stopped it (then no
    rounds: a partial set of rounds would not be compared on equal terms)."""

    rounds: list[list[float]] = dataclasses.field(default_factory=list)
    error: Exception | None = None


def call_timer(device: str) -> Callable[[Step], float]:
    """Seconds one call of a step takes: CUDA events on the current (bench) stream on a GPU, where
    every contender's work is queued, else the host clock."""
    if device != "cuda":
        def host_clock(step: Step) -> float:
            start = time.perf_counter()
            step()
            return time.perf_counter() - start

        return host_clock
    import torch

    def cuda_events(step: Step) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return cuda_events


@contextlib.contextmanager
def bench_stream(device: str, tf32: bool):
    """On a GPU, one non-default stream for every contender (ONNX Runtime's sessions are given it),
    and PyTorch's TF32 switches set as ONNX Runtime's are, so fp32 means the same on both sides."""
    if device != "cuda":
        yield
        return
    import torch

    switches = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = [switch.allow_tf32 for switch in switches]
    try:
        for switch in switches:
            switch.allow_tf32 = tf32
        with torch.cuda.stream(torch.cuda.Stream()):
            yield
    finally:
        for switch, value in zip(switches, saved):
            switch.allow_tf32 = value


def stream_pointer(device: str) -> int | None:
    """The stream ONNX Runtime must run on to be timed: torch's current one, which is the bench stream."""
    if device != "cuda":
        return None
    from deploykit.backends.base.memory import TorchMemory

    return TorchMemory(0).stream()


def calls_per_round(budget) -> list[int]:
    """``budget.iterations`` calls shared out over the rounds as evenly as they go (fewer rounds than
    ``budget.rounds`` when there are fewer calls)."""
    count = min(budget.rounds, budget.iterations)
    share, extra = divmod(budget.iterations, count)
    return [share + (index < extra) for index in range(count)]


def round_order(count: int, index: int, rounds: int) -> list[int]:
    """The order round ``index`` of ``rounds`` times ``count`` steps in: the list rotated, its start
    moving by ``count // rounds`` (at least 1) a round, so no step is always first or last."""
    start = index * max(1, count // rounds) % count
    return [(start + offset) % count for offset in range(count)]


def interleave(steps: list[Step], budget, tick=lambda text: None) -> list[Timed]:
    """Each step warmed up, then timed in rounds: every round times every step in turn (in
    :func:`round_order`) for its share of the calls and of ``max_seconds``, so slow drift (clocks,
    heat) falls on all steps alike instead of on whichever is timed last. A step that raises is
    left out of the later rounds, with its error; the others go on.

    ``budget`` is a :class:`Budget` or anything with its fields (bench's Settings).
    """
    timed = [Timed() for _ in steps]
    if not steps:
        return timed
    for step, result in zip(steps, timed):
        _attempt(result, warm_up, step, budget.warmup)
    timer, plan = call_timer(budget.device), calls_per_round(budget)
    seconds = budget.max_seconds / len(plan)
    for index, calls in enumerate(plan):
        tick(f"round {index + 1}/{len(plan)}")
        for position in round_order(len(steps), index, len(plan)):
            step, result = steps[position], timed[position]
            if result.error is None:
                times = _attempt(result, time_calls, step, calls, seconds, timer)
                if result.error is None:
                    result.rounds.append(times)
    return timed


def _attempt(result: Timed, work: Callable, *args):
    """``work(*args)``; an exception ends this step's timing (recorded), not everyone's."""
    try:
        return work(*args)
    except Exception as error:  # noqa: BLE001 - one backend failing must not end the run
        result.error, result.rounds = error, []
        return None


def warm_up(step: Step, calls: int) -> None:
    for _ in range(calls):
        step()


def time_calls(step: Step, calls: int, seconds: float, timer: Callable[[Step], float]) -> list[float]:
    """Up to ``calls`` timed calls of ``step``, stopping after ``seconds`` (at least one call)."""
    times, deadline = [], time.perf_counter() + seconds
    while len(times) < calls and (not times or time.perf_counter() < deadline):
        times.append(timer(step))
    return times


def round_stats(rounds: list[list[float]]) -> dict:
    """``p50_ms``: the median of the rounds' median calls (steady against one slow round);
    ``round_p50_ms``, those medians in round order, and ``spread``, their range over ``p50_ms``,
    say how far the rounds agree."""
    medians = [float(np.median(times)) * 1e3 for times in rounds]
    p50 = float(np.median(medians))
    return {"p50_ms": p50, "round_p50_ms": medians, "spread": (max(medians) - min(medians)) / p50 if p50 else 0.0}


def summarize(rounds: list[list[float]], batch: int) -> dict:
    """:func:`round_stats`, and p90/p99, mean, coefficient of variation and samples per second
    over all calls."""
    ms = np.concatenate(rounds) * 1e3
    mean = float(ms.mean())
    p90, p99 = (float(v) for v in np.percentile(ms, [90, 99]))
    return {"batch": batch, "iterations": len(ms), "rounds": len(rounds), **round_stats(rounds), "p90_ms": p90,
            "p99_ms": p99, "mean_ms": mean, "cv": float(ms.std() / mean) if mean else 0.0,
            "throughput": batch / (mean / 1e3) if mean else 0.0}
