"""Calls into a session on the CUDA provider with as little work per call as the shapes allow.

Everything a call needs that depends only on the input shapes is made once per shape: the
IOBinding, the output buffers and, with CUDA graphs, input buffers at fixed addresses and the
shape's graph. A graph is replayed on the caller's current stream, between the copies into its
inputs and out of its outputs. The session itself runs on a stream of its own
(``user_compute_stream``), ordered after the caller's current stream and the caller's after it
by events, and ONNX Runtime is told not to synchronise at the end of a run, so nothing waits
for the whole device and outputs are ready for whatever the caller queues next on its stream.

The graphs are torch's (``torch.cuda.CUDAGraph``), captured around one ``run_with_iobinding``,
not ONNX Runtime's own (run option ``gpu_graph_id``): ONNX Runtime's CUDA provider waits for its
stream after every replay of its own graphs, which puts all of a call's Python work between two
GPU runs; a replay of ours is queued like any kernel. The session is still made with
``enable_cuda_graph`` (ONNX Runtime then refuses graphs whose nodes would leave the CUDA
provider), and every run asks it not to capture (``gpu_graph_id`` -1). A capture needs the
shape's memory in ONNX Runtime's arena and cuDNN's algorithms chosen, so a shape runs
``WARMUP_RUNS`` times uncaptured first. A capture holds the process's GPU lock alone
(``backends.base.capture``); replays share it. A graph replays ONNX Runtime's intermediate
buffers of the run it captured, so the calls of one session take turns (its own lock).

All of a call's streams are on the session's device, so they are told apart by their handles
(``cuda_stream``): a torch Stream's ``==`` is Python, on every call's path.

Needs torch (its allocator, streams, events and graphs); without torch the runner binds pointers
and lets ONNX Runtime synchronise (``OnnxRuntimeRunner``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import numpy as np

from deploykit.backends.base.capture import GPU_WORK
from deploykit.backends.base.feeds import Feed, numpy_dtype
from deploykit.backends.base.memory import TorchMemory
from deploykit.errors import error_summary

#: Uncaptured runs of a new input shape before its graph is captured: the first may search
#: cuDNN's algorithms and grow ONNX Runtime's arena, neither of which a capture may do.
WARMUP_RUNS = 2


@dataclasses.dataclass
class ShapePlan:
    """One input shape's binding and its outputs' shapes. With CUDA graphs, ``inputs`` and
    ``outputs`` are the fixed-address buffers bound once (without, the caller's tensors and fresh
    outputs are bound on every call), and ``graph`` is the shape's graph once captured."""

    binding: object
    output_shapes: list[tuple[int, ...]]
    inputs: list | None = None  # in the order of the call's inputs
    outputs: list | None = None
    graph: object = None  # torch.cuda.CUDAGraph
    runs: int = 0

    @property
    def uncapturable(self) -> bool:
        """Its capture was tried (on run ``WARMUP_RUNS`` + 1) and failed: it runs uncaptured."""
        return self.inputs is not None and self.graph is None and self.runs > WARMUP_RUNS


class CudaRuns:
    """Per-shape plans over one session. ``graphs``: capture and replay a CUDA graph per shape;
    a shape whose capture failed is named in ``notes`` (the runner's, which it hands in)."""

    def __init__(self, session, output_specs: list[dict], device_id: int, stream, graphs: bool):
        import onnxruntime as ort
        import torch

        self.torch, self.session, self.specs = torch, session, output_specs
        self.device, self.device_id = torch.device("cuda", device_id), device_id
        self.device_name = str(self.device)  # a torch feed's ``torch_device`` when it is on this GPU
        self.memory = TorchMemory(device_id)
        self.stream, self.graphs = stream, graphs  # the session's torch.cuda.Stream
        self.plans: dict[tuple, ShapePlan | None] = {}  # None: that input shape has no plan
        self.notes: list[str] = []
        self._turns = threading.Lock()
        self._last = None  # the stream the session's last call was ordered on
        self.options = ort.RunOptions()  # a planned run: no synchronise at its end
        self.options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        self.uncaptured = ort.RunOptions()  # for calls that cannot have a plan (outputs of unknown shape)
        if graphs:  # ONNX Runtime never captures: the graphs are ours
            for options in (self.options, self.uncaptured):
                options.add_run_config_entry("gpu_graph_id", "-1")

    def run(self, given: dict[str, Feed], output_shapes) -> list | None:
        """Output tensors (the caller's to keep), or None when the outputs' shapes do not follow from
        the inputs' (no plan can bind them). ``output_shapes(given)`` is asked once per input shape."""
        key = tuple([(name, feed.shape, feed.dtype) for name, feed in given.items()])
        with self._turns:
            plan = self.plans.get(key)
            capturing = plan is not None and self._captures_next(plan)
            with GPU_WORK.around(capturing):
                if plan is None and key not in self.plans:  # the shape's first call
                    shapes = output_shapes(given)
                    plan = self.plans[key] = None if None in shapes else self._plan(given, shapes)
                return None if plan is None else self._run(plan, given, capturing)

    @contextlib.contextmanager
    def turn(self):
        """This session's turn for a run outside the plans (which ONNX Runtime synchronises): after
        the session's last call is done, as a replay on another stream may still use its buffers."""
        with self._turns:
            if self._last is not None:
                self._last.synchronize()
            yield

    def _captures_next(self, plan: ShapePlan) -> bool:
        return plan.inputs is not None and plan.graph is None and plan.runs == WARMUP_RUNS

    def _run(self, plan: ShapePlan, given: dict[str, Feed], capturing: bool) -> list:
        """A replay is queued on the caller's stream itself; a run of the session on the session's
        stream, between events. Either way the call is ordered after the session's last call, which
        may have come from another stream. ``capturing``: this run is the shape's capture."""
        caller = self.torch.cuda.current_stream(self.device_id)
        if self._last is not None and self._last.cuda_stream != caller.cuda_stream:
            caller.wait_stream(self._last)
        self._last = caller
        tensors = [self._tensor(feed) for feed in given.values()]
        if plan.inputs is None:
            return self._run_bound(plan, given, tensors, caller)
        self.copy_inputs(plan, tensors)
        if capturing:
            plan.graph = self._capture(plan)
        plan.runs += 1
        if plan.graph is not None:
            plan.graph.replay()
        else:
            self._run_session(plan, caller)
        return self.copy_outputs(plan)

    def copy_inputs(self, plan: ShapePlan, tensors: list) -> None:
        """The call's inputs into the plan's graph buffers, on the current stream."""
        self.torch._foreach_copy_(plan.inputs, tensors, non_blocking=True)

    def copy_outputs(self, plan: ShapePlan) -> list:
        """Copies of the plan's graph outputs, the caller's to keep (the next replay overwrites them)."""
        results = [self.torch.empty_like(buffer) for buffer in plan.outputs]
        self.torch._foreach_copy_(results, plan.outputs, non_blocking=True)
        return results

    def _run_bound(self, plan: ShapePlan, given: dict[str, Feed], tensors: list, caller) -> list:
        """Without CUDA graphs: the caller's tensors and fresh outputs bound for this one run."""
        for name, tensor in zip(given, tensors):
            self._bind_input(plan.binding, name, tensor)
        results = self._empty_outputs(plan.output_shapes)  # allocated for the caller's stream
        for spec, tensor in zip(self.specs, results):
            self._bind_output(plan.binding, spec["name"], tensor)
        plan.runs += 1
        self._run_session(plan, caller)
        return results

    def _run_session(self, plan: ShapePlan, caller) -> None:
        """The plan's binding run on the session's stream, after the caller's work so far and before its next."""
        elsewhere = self.stream.cuda_stream != caller.cuda_stream
        if elsewhere:
            self.stream.wait_stream(caller)
        self.session.run_with_iobinding(plan.binding, self.options)
        if elsewhere:
            caller.wait_stream(self.stream)

    def _capture(self, plan: ShapePlan):
        """The shape's run captured as a graph (on the session's stream, where ONNX Runtime queues its
        kernels), or None, noted, where ONNX Runtime's run cannot be captured."""
        torch = self.torch
        graph = torch.cuda.CUDAGraph()
        try:  # (torch.cuda.graph synchronises the device first: the input copies are done)
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                self.session.run_with_iobinding(plan.binding, self.options)
        except Exception as error:  # noqa: BLE001 - torch's and ONNX Runtime's errors alike
            shape = "x".join(map(str, plan.inputs[0].shape))
            self.notes.append(f"input shape {shape} runs without a CUDA graph: its capture failed "
                              f"({error_summary(error)[:200]})")
            return None
        return graph

    def _plan(self, given: dict[str, Feed], shapes: list[tuple[int, ...]]) -> ShapePlan:
        plan = ShapePlan(self.session.io_binding(), shapes)
        if self.graphs:
            plan.inputs = [self.torch.empty(feed.shape, dtype=_torch_dtype(feed.dtype.name), device=self.device)
                           for feed in given.values()]
            plan.outputs = self._empty_outputs(shapes)
            for name, tensor in zip(given, plan.inputs):
                self._bind_input(plan.binding, name, tensor)
            for spec, tensor in zip(self.specs, plan.outputs):
                self._bind_output(plan.binding, spec["name"], tensor)
        return plan

    def _empty_outputs(self, shapes: list[tuple[int, ...]]) -> list:
        return [self.torch.empty(shape, dtype=_torch_dtype(spec["dtype"]), device=self.device)
                for spec, shape in zip(self.specs, shapes)]

    def _tensor(self, feed: Feed):
        """A feed as a CUDA tensor on this device (host arrays are copied over, CUDA arrays wrapped)."""
        torch = self.torch
        if feed.torch_device == self.device_name:
            return feed.value
        if feed.torch_device is not None and feed.on_device:
            return feed.value.to(self.device)
        if feed.on_device:
            return torch.as_tensor(feed.value, device=self.device)
        return self.memory.to_device(feed.value)

    def _bind_input(self, binding, name: str, tensor) -> None:
        binding.bind_input(name, "cuda", self.device_id, _numpy_dtype(tensor), list(tensor.shape), tensor.data_ptr())

    def _bind_output(self, binding, name: str, tensor) -> None:
        binding.bind_output(name, "cuda", self.device_id, _numpy_dtype(tensor), list(tensor.shape), tensor.data_ptr())


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)  # numpy's and torch's names agree for every ONNX tensor type ORT binds


def _numpy_dtype(tensor) -> np.dtype:
    return numpy_dtype(str(tensor.dtype).removeprefix("torch."))
