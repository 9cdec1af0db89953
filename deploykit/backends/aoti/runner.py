"""The AOTInductor runner: a bundle's AOTInductor packages of one device, one runner for all of
them. Each call goes to the static package compiled for its batch size when there is one, else to
the dynamic package; on a GPU a package may be replayed as one CUDA graph per input shape.
"""

from __future__ import annotations

import contextlib

import numpy as np

from deploykit.backends.aoti.loader import Package
from deploykit.backends.base.capture import GPU_WORK
from deploykit.backends.base.feeds import (
    DeviceArray, Feed, numpy_dtype, output_kind,
)
from deploykit.backends.base.memory import torch_from_host, torch_to_host
from deploykit.backends.base.runner import Runner
from deploykit.errors import BadInputError, EnvironmentProblem, error_summary


class AotiRunner(Runner):
    """AOTInductor packages fed numpy, torch (CPU or CUDA) or ``__cuda_array_interface__`` arrays.

    ``inputs``/``outputs`` are the manifest's specs (inputs in the bundle's io dtype), whose batch
    range is enforced (``allow_unvalidated`` runs other batches that a package accepts, with a
    note). ``cast_inputs`` casts host feeds to those dtypes first (conversion feeds the declared
    types). ``served`` maps each batch size run to the package file that ran it.
    """

    backend = "aoti"

    def __init__(self, packages: list[Package], device: str, device_id: int = 0, *, inputs: list[dict],
                 outputs: list[dict], notes: list[str] | None = None, name: str | None = None, bundle=None,
                 allow_unvalidated: bool = False, cast_inputs: bool = False):
        import torch

        super().__init__(device, inputs, outputs, notes=notes, name=name, bundle=bundle)
        if not packages:
            raise BadInputError("no AOTInductor package to run")
        self.torch, self.packages, self.device_id = torch, packages, device_id
        self.torch_device = torch.device("cuda", device_id) if device == "cuda" else torch.device("cpu")
        self.allow_unvalidated, self.cast_inputs = allow_unvalidated, cast_inputs
        self.served: dict[int, str] = {}
        self._graphs: dict[tuple, CudaGraph] = {}

    def describe(self) -> dict:
        return {**super().describe(), "packages": [p.describe() for p in self.packages],
                "cuda_graph": [p.file for p in self.packages if p.cuda_graph]}

    def package_for(self, batch: int) -> Package:
        """The static package of this batch size, else the dynamic package whose range holds it."""
        static = next((p for p in self.packages if p.static and p.accepts(batch)), None)
        chosen = static or next((p for p in self.packages if p.accepts(batch)), None)
        if chosen is None:
            held = ", ".join(p.describe() for p in self.packages)
            raise BadInputError(f"batch {batch}: no AOTInductor package loaded here runs it ({held}); a package "
                                "runs only the batch sizes it was compiled for: convert with a wider --batch")
        return chosen

    def run(self, feeds=None, /, **named) -> dict:
        if self.cast_inputs:
            feeds = {spec["name"]: np.asarray(feeds[spec["name"]]).astype(numpy_dtype(spec["dtype"]), copy=False)
                     for spec in self.inputs}
        given = self.checked_feeds(feeds, named)
        kind, device = output_kind(given)
        batch = given[self.input_names[0]].shape[0]
        package = self.package_for(batch)
        self.served[batch] = package.file
        key = (package.file, *(given[name].shape for name in self.input_names))
        capturing = package.cuda_graph and key not in self._graphs
        with self._gpu_work(capturing), self.torch.inference_mode(), exact_fp32(package.entry):
            tensors = [self._tensor(given[name]) for name in self.input_names]
            outputs = self._call(package, tensors, key)
            return {name: self._deliver(tensor, kind, device) for name, tensor in zip(self.output_names, outputs)}

    def _gpu_work(self, capturing: bool):
        """The process's GPU lock (``backends.base.capture``): alone while a graph is captured."""
        return GPU_WORK.around(capturing) if self.torch_device.type == "cuda" else contextlib.nullcontext()

    def _call(self, package: Package, tensors: list, key: tuple) -> list:
        if not package.cuda_graph:
            return flat_outputs(package.model(*tensors))
        graph = self._graphs.get(key)
        if graph is None:
            try:
                graph = self._graphs[key] = CudaGraph(package.model, tensors)
            except EnvironmentProblem as problem:
                package.cuda_graph = False
                self.warn(f"{package.file}: {problem}; it runs without CUDA graphs")
                return flat_outputs(package.model(*tensors))
        return graph(tensors)

    def _tensor(self, feed: Feed):
        """A feed as a torch tensor on the runner's device, without a copy where it is there already."""
        if not feed.on_device:  # numpy, or a CPU tensor's numpy view
            return torch_from_host(feed.value).to(self.torch_device)
        if feed.torch_device is not None:
            return feed.value.to(self.torch_device)
        return self.torch.as_tensor(feed.value, device=self.torch_device)  # another library's CUDA array

    def _deliver(self, tensor, kind: str, device: str | None):
        """An output in the form the inputs came in: torch on their device, a device array, or numpy."""
        if kind == "torch":
            return tensor.to(device)
        if kind == "device":
            dtype = str(tensor.dtype).removeprefix("torch.")
            return DeviceArray(tensor.data_ptr(), tensor.shape, numpy_dtype(dtype), owner=tensor)
        return torch_to_host(tensor)


class CudaGraph:
    """One package captured as a CUDA graph for one set of input shapes: inputs are copied into its
    static buffers, the graph is replayed on the caller's current stream, and the outputs are
    copied out (the next replay overwrites the static outputs)."""

    def __init__(self, model, example: list):
        import torch

        self.torch = torch
        self.inputs = [tensor.clone() for tensor in example]
        side = torch.cuda.Stream(example[0].device)
        side.wait_stream(torch.cuda.current_stream(example[0].device))
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                model(*self.inputs)  # warm-up: lazy initialisation stays out of the graph
            torch.cuda.current_stream(example[0].device).wait_stream(side)
            with torch.cuda.graph(self.graph):
                self.outputs = flat_outputs(model(*self.inputs))
        except RuntimeError as error:
            raise EnvironmentProblem(f"cannot be captured as a CUDA graph ({error_summary(error)[:200]})") from error

    def __call__(self, tensors: list) -> list:
        for static, tensor in zip(self.inputs, tensors):
            static.copy_(tensor)
        self.graph.replay()
        return [output.clone() for output in self.outputs]


def flat_outputs(result) -> list:
    """An AOTInductor model returns one tensor or a sequence of them."""
    return list(result) if isinstance(result, (tuple, list)) else [result]


@contextlib.contextmanager
def exact_fp32(entry: dict):
    """An fp32 cuda package computes in exact fp32, as it was validated: torch's convolutions would round
    to TF32 by default (``torch.backends.cudnn.allow_tf32``), as the kernels it calls read torch's flags."""
    import torch

    if entry["device"] != "cuda" or entry["precision"] != "fp32":
        yield
        return
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
