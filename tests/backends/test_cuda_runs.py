"""``CudaRuns``' ordering of a call, on the CPU: torch's CUDA streams, graphs and device buffers are
stood in for by fakes that log what the GPU would be asked, and CPU tensors by CUDA feeds."""

from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest
import torch

from deploykit.backends.base.capture import GPU_WORK
from deploykit.backends.base.feeds import Feed
from deploykit.backends.onnxruntime import cuda_runs
from deploykit.backends.onnxruntime.cuda_runs import WARMUP_RUNS, CudaRuns

OUTPUTS = [{"name": "y", "dtype": "float32", "shape": ["batch", 3]}]


class Stream:
    def __init__(self, handle: int, log: list):
        self.cuda_stream, self.log = handle, log

    def wait_stream(self, other: Stream) -> None:
        self.log.append(("wait", self.cuda_stream, other.cuda_stream))


class Graph:
    def __init__(self, log: list):
        self.log = log

    def replay(self) -> None:
        self.log.append("replay")


class Session:
    def __init__(self, log: list):
        self.log = log

    def io_binding(self):
        return types.SimpleNamespace(bind_input=lambda *args: None, bind_output=lambda *args: None)

    def run_with_iobinding(self, binding, options) -> None:
        self.log.append("session run")


@pytest.fixture
def fake(monkeypatch):
    """A CudaRuns whose session's stream is 9 and whose callers' current stream is ``fake.current``."""
    log = []
    fake = types.SimpleNamespace(log=log, current=Stream(1, log))

    @contextlib.contextmanager
    def capture(graph, stream, capture_error_mode):
        log.append(("capture", stream.cuda_stream, "alone" if GPU_WORK._capturing else "shared"))
        yield

    shim = types.SimpleNamespace(
        cuda=types.SimpleNamespace(current_stream=lambda device: fake.current, CUDAGraph=lambda: Graph(log), graph=capture),
        empty=lambda shape, dtype, device: torch.empty(shape, dtype=dtype),
        empty_like=torch.empty_like, _foreach_copy_=torch._foreach_copy_)
    monkeypatch.setattr(cuda_runs, "TorchMemory", lambda device_id: None)
    fake.runs = CudaRuns(Session(log), OUTPUTS, 0, Stream(9, log), graphs=True)
    fake.runs.torch = shim
    return fake


def cuda_feed(batch: int) -> dict[str, Feed]:
    tensor = torch.ones(batch, 2)
    return {"x": Feed("x", tensor, (batch, 2), np.dtype("float32"), True, "cuda:0")}


def test_a_shape_runs_uncaptured_then_is_captured_alone_and_replayed(fake):
    asked = []

    def shapes(given):
        asked.append(given["x"].shape)
        return [(given["x"].shape[0], 3)]

    for _ in range(WARMUP_RUNS + 2):
        (output,) = fake.runs.run(cuda_feed(2), shapes)
        assert output.shape == (2, 3)
    warm_up = [("wait", 9, 1), "session run", ("wait", 1, 9)]  # the session's stream between the caller's work
    assert fake.log == warm_up * WARMUP_RUNS + [("capture", 9, "alone"), "session run", "replay", "replay"]
    assert asked == [(2, 2)]
    (plan,) = fake.runs.plans.values()
    assert output is not plan.outputs[0]  # a copy: the next replay overwrites the plan's


def test_a_call_from_another_stream_is_ordered_after_the_last_call(fake):
    for _ in range(WARMUP_RUNS + 1):
        fake.runs.run(cuda_feed(1), lambda given: [(1, 3)])
    fake.log.clear()
    fake.runs.run(cuda_feed(1), lambda given: [(1, 3)])
    assert fake.log == ["replay"]  # the same stream as the last call: nothing to wait for
    fake.log.clear()
    fake.current = Stream(2, fake.log)
    fake.runs.run(cuda_feed(1), lambda given: [(1, 3)])
    assert fake.log == [("wait", 2, 1), "replay"]


def test_outputs_of_unknown_shape_have_no_plan(fake):
    assert fake.runs.run(cuda_feed(1), lambda given: [None]) is None
    assert list(fake.runs.plans.values()) == [None] and fake.log == []
