"""Calls into a session on the CUDA provider at ONNX Runtime's own floor.

Everything a call needs that depends only on the input shapes is made once per shape: the
IOBinding, the output buffers and, with CUDA graphs, input buffers at fixed addresses and a graph
id (ONNX Runtime captures a shape's graph on its first runs and replays it after; run option
``gpu_graph_id``). The session runs on a stream of its own (``user_compute_stream``): each call
orders that stream after the caller's current stream and the caller's after it with events, and
ONNX Runtime is told not to synchronise at the end of a run, so nothing waits for the whole
device and outputs are ready for whatever the caller queues next on its stream.

A plan's first ``CAPTURE_RUNS`` runs in a thread may capture its graph, so they hold the process's GPU lock
alone (``backends.base.capture``); later runs share it.

Needs torch (its allocator, streams and events); without torch the runner binds pointers and
lets ONNX Runtime synchronise (``OnnxRuntimeRunner``).
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np

from deploykit.backends.base.capture import GPU_WORK
from deploykit.backends.base.feeds import Feed, numpy_dtype
from deploykit.backends.base.memory import TorchMemory

#: ONNX Runtime's CUDA provider runs a new graph id uncaptured (one or two runs, by version, so its
#: arena has allocated everything) and captures it on the run after. It keeps graphs per calling
#: thread, so a plan's runs are counted per thread.
CAPTURE_RUNS = 3


@dataclasses.dataclass
class ShapePlan:
    """One input shape's binding and its outputs' shapes and dtypes. With a captured graph,
    ``inputs`` and ``outputs`` are its fixed-address buffers (without one, the caller's tensors
    and fresh outputs are bound on every call)."""

    binding: object
    options: object  # onnxruntime.RunOptions
    output_shapes: list[tuple[int, ...]]
    inputs: dict | None = None
    outputs: list | None = None
    runs: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # thread id -> runs


class CudaRuns:
    """Per-shape plans over one session. ``graphs``: capture and replay a CUDA graph per shape."""

    def __init__(self, session, output_specs: list[dict], device_id: int, stream, graphs: bool):
        import onnxruntime as ort
        import torch

        self.torch, self.session, self.specs = torch, session, output_specs
        self.device, self.device_id = torch.device("cuda", device_id), device_id
        self.memory = TorchMemory(device_id)
        self.stream, self.graphs = stream, graphs  # the session's torch.cuda.Stream
        self.plans: dict[tuple, ShapePlan | None] = {}  # None: that input shape has no plan
        self.uncaptured = ort.RunOptions()  # for calls that cannot have a plan (outputs of unknown shape)
        if graphs:
            self.uncaptured.add_run_config_entry("gpu_graph_id", "-1")

    def run(self, given: dict[str, Feed], output_shapes) -> list | None:
        """Output tensors (the caller's to keep), or None when the outputs' shapes do not follow from
        the inputs' (no plan can bind them). ``output_shapes(given)`` is asked once per input shape."""
        key = tuple((name, feed.shape, feed.dtype.str) for name, feed in given.items())
        with GPU_WORK.around(self._may_capture(key)):
            plan = self.plans.get(key)
            if key not in self.plans:
                shapes = output_shapes(given)
                plan = self.plans[key] = None if None in shapes else self._plan(given, shapes)
            if plan is None:
                return None
            plan.runs[threading.get_ident()] += 1
            return self._run(plan, given)

    def _may_capture(self, key: tuple) -> bool:
        if not self.graphs or key not in self.plans:
            return self.graphs
        plan = self.plans[key]
        return plan is not None and plan.runs[threading.get_ident()] < CAPTURE_RUNS

    def _run(self, plan: ShapePlan, given: dict[str, Feed]) -> list:
        torch, stream = self.torch, self.stream
        caller = torch.cuda.current_stream(self.device)
        tensors = {name: self._tensor(feed) for name, feed in given.items()}
        if stream != caller:
            stream.wait_stream(caller)
        if plan.inputs is None:
            for name, tensor in tensors.items():
                self._bind_input(plan.binding, name, tensor)
            results = self._empty_outputs(plan.output_shapes)  # allocated for the caller's stream
            for spec, tensor in zip(self.specs, results):
                self._bind_output(plan.binding, spec["name"], tensor)
        else:
            with torch.cuda.stream(stream):
                for name, tensor in tensors.items():
                    plan.inputs[name].copy_(tensor, non_blocking=True)
        self.session.run_with_iobinding(plan.binding, plan.options)
        if plan.inputs is not None:  # the next replay overwrites the graph's outputs: hand out copies
            results = [torch.empty_like(buffer) for buffer in plan.outputs]
            with torch.cuda.stream(stream):
                for result, buffer in zip(results, plan.outputs):
                    result.copy_(buffer, non_blocking=True)
        if stream != caller:
            caller.wait_stream(stream)
        return results

    def _plan(self, given: dict[str, Feed], shapes: list[tuple[int, ...]]) -> ShapePlan:
        import onnxruntime as ort

        options = ort.RunOptions()
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        plan = ShapePlan(self.session.io_binding(), options, shapes)
        if self.graphs:
            graph_id = 1 + sum(made is not None for made in self.plans.values())  # 0 is ORT's default graph
            options.add_run_config_entry("gpu_graph_id", str(graph_id))
            plan.inputs = {name: self.torch.empty(feed.shape, dtype=_torch_dtype(feed.dtype.name), device=self.device)
                           for name, feed in given.items()}
            plan.outputs = self._empty_outputs(shapes)
            for name, tensor in plan.inputs.items():
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
        if feed.torch_device is not None and feed.on_device:
            tensor = feed.value
            return tensor if tensor.device == self.device else tensor.to(self.device)
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
