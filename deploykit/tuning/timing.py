"""How deploykit times one inference, shared by ``bench`` and ``tune`` so their numbers mean the same.

A contender is a zero-argument step that runs one inference to completion. On a GPU every step
runs on one non-default stream (ONNX Runtime is handed it as its ``user_compute_stream``) and each
call is timed by CUDA events recorded on that stream before and after it: the latency of one
synchronous inference, launch gaps included. On the CPU the host clock is read around each call.
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
    """How long to time one step: ``warmup`` untimed calls, then up to ``iterations`` timed ones,
    stopping after ``max_seconds`` (at least 5 calls)."""

    device: str = "cpu"
    warmup: int = 10
    iterations: int = 100
    max_seconds: float = 20.0


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


def measure(step: Step, budget) -> list[float]:
    """Seconds per call after ``budget.warmup`` calls; at least 5 calls, then stop at ``budget.max_seconds``.

    ``budget`` is a :class:`Budget` or anything with its fields (bench's Settings).
    """
    for _ in range(budget.warmup):
        step()
    timer, times, deadline = call_timer(budget.device), [], time.perf_counter() + budget.max_seconds
    for index in range(budget.iterations):
        times.append(timer(step))
        if time.perf_counter() > deadline and index >= 4:
            break
    return times


def summarize(times: list[float], batch: int) -> dict:
    """Latency percentiles (ms), mean, coefficient of variation and samples per second."""
    ms = np.asarray(times) * 1e3
    mean = float(ms.mean())
    p50, p90, p99 = (float(v) for v in np.percentile(ms, [50, 90, 99]))
    return {"batch": batch, "iterations": len(times), "p50_ms": p50, "p90_ms": p90, "p99_ms": p99, "mean_ms": mean,
            "cv": float(ms.std() / mean) if mean else 0.0, "throughput": batch / (mean / 1e3) if mean else 0.0}
