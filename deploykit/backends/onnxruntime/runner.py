"""The ONNX Runtime runner: one class over a session, for conversion-time validation (an
in-memory graph, numpy in and out), ``deploykit.load`` (a bundle's graph, numpy, torch or
CUDA arrays) and bench, profile and debug.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from deploykit.backends.onnxruntime import loader
from deploykit.backends.base.feeds import (
    DeviceArray, Feed, deliver_host, imported_torch, output_kind,
)
from deploykit.backends.base.memory import TorchMemory
from deploykit.backends.base.runner import Runner
from deploykit.backends.base.capture import GPU_WORK
from deploykit.backends.onnxruntime.cuda_runs import CudaRuns


class OnnxRuntimeRunner(Runner):
    """An InferenceSession fed and read by name; CUDA inputs stay on the GPU (IOBinding).

    Specs default to the session's own; a bundle loader passes the manifest's, whose batch range
    is then enforced (``allow_unvalidated`` runs other batches, with a note). ``model_path`` and
    ``library`` say what the session was made from (None for in-memory graphs).
    """

    backend = "onnxruntime"

    def __init__(self, session, device: str = "cpu", device_id: int = 0, *, inputs: list[dict] | None = None,
                 outputs: list[dict] | None = None, model_path: Path | None = None, library: Path | None = None,
                 notes: list[str] | None = None, bundle=None, allow_unvalidated: bool = False,
                 cuda_runs: CudaRuns | None = None):
        super().__init__(device, inputs or session_specs(session.get_inputs()),
                         outputs or session_specs(session.get_outputs()), notes=notes, bundle=bundle)
        self.session, self.device_id = session, device_id
        self.provider = session.get_providers()[0]
        self.model_path, self.library = model_path, library
        self.allow_unvalidated = allow_unvalidated
        self.cuda_runs = cuda_runs  # the per-shape fast path on the CUDA provider (torch present)
        if cuda_runs is not None:
            cuda_runs.notes = self.notes  # a shape whose graph capture failed is named here

    @classmethod
    def from_model(cls, model, op_library: Path | None = None) -> OnnxRuntimeRunner:
        """Conversion-time validation: an in-memory graph (ModelProto) on the CPU provider."""
        session = loader.create_session(model, loader.session_options(op_library=op_library))
        return cls(session, library=op_library)

    def describe(self) -> dict:
        return {**super().describe(), "provider": self.provider,
                "model": self.model_path.name if self.model_path else None,
                "op_library": self.library.name if self.library else None,
                "cuda_graph": bool(self.cuda_runs and self.cuda_runs.graphs)}

    def run(self, feeds=None, /, **named) -> dict:
        given = self.checked_feeds(feeds, named)
        kind, device = output_kind(given)
        if self.cuda_runs is not None and (outputs := self.cuda_runs.run(given, self.output_shapes)) is not None:
            memory = self.cuda_runs.memory
            if memory.delivers_as_is(kind, device):
                return dict(zip(self.output_names, outputs))
            return {name: memory.deliver(tensor, kind, device) for name, tensor in zip(self.output_names, outputs)}
        if self.device != "cuda":
            return self._run_host(given, kind, device)
        turn = self.cuda_runs.turn() if self.cuda_runs is not None else contextlib.nullcontext()
        with GPU_WORK.shared(), turn:  # no graph is captured meanwhile (backends.base.capture)
            if any(feed.on_device for feed in given.values()):
                return self._run_bound(given, kind, device)
            return self._run_host(given, kind, device)

    def _run_host(self, given: dict[str, Feed], kind: str, device: str | None) -> dict:
        host = {name: feed.host() for name, feed in given.items()}
        values = self.session.run(None, host, self._uncaptured())
        return {name: deliver_host(value, kind, device) for name, value in zip(self.output_names, values)}

    def _run_bound(self, given: dict[str, Feed], kind: str, device: str | None) -> dict:
        """IOBinding: CUDA inputs by pointer; outputs into preallocated torch tensors when their
        shapes follow from the inputs', else allocated by ORT and shared without a copy."""
        binding = self.session.io_binding()
        for name, feed in given.items():
            if feed.on_device:
                binding.bind_input(name, "cuda", self.device_id, feed.dtype, list(feed.shape), feed.pointer)
            else:
                binding.bind_cpu_input(name, feed.host())
        shapes = self.output_shapes(given)
        results = {}
        for spec, shape in zip(self.outputs, shapes):
            name = spec["name"]
            if kind == "torch" and shape is not None:
                tensor = TorchMemory(self.device_id).empty(shape, spec["dtype"])
                binding.bind_output(name, "cuda", self.device_id, np.dtype(spec["dtype"]), list(shape),
                                    tensor.data_ptr())
                results[name] = tensor
            else:
                binding.bind_output(name, "cuda", self.device_id)
        if kind == "torch":
            TorchMemory(self.device_id).synchronize()  # inputs may still be computed on torch's stream
        self.session.run_with_iobinding(binding, self._uncaptured())
        for name, value in zip(self.output_names, binding.get_outputs()):
            if name not in results:
                results[name] = self._deliver_ort_value(value, kind, device)
        return {name: results[name] for name in self.output_names}

    def _uncaptured(self):
        """Run options for a call outside the per-shape plans: never captured as a CUDA graph."""
        return self.cuda_runs.uncaptured if self.cuda_runs is not None else None

    def output_shapes(self, given: dict[str, Feed]) -> list[tuple[int, ...] | None]:
        """Output shapes from the session's symbolic dims bound to the inputs' sizes (None: unknown)."""
        sizes = {}
        for meta in self.session.get_inputs():
            for dim, size in zip(meta.shape, given[meta.name].shape):
                if isinstance(dim, str):
                    sizes[dim] = size
        shapes = []
        for meta in self.session.get_outputs():
            dims = [d if isinstance(d, int) and d >= 0 else sizes.get(d) for d in meta.shape]
            shapes.append(None if any(d is None for d in dims) else tuple(dims))
        return shapes

    def _deliver_ort_value(self, value, kind: str, device: str | None):
        if kind == "numpy":
            return value.numpy()
        array = DeviceArray(value.data_ptr(), value.shape(), ort_dtype_name(value.data_type()), owner=value)
        if kind == "torch":
            return imported_torch().as_tensor(array, device=device)
        return array

    def end_profiling(self) -> str:
        return self.session.end_profiling()


def session_specs(metas) -> list[dict]:
    """Specs of a session's inputs or outputs (NodeArg): name, dtype name, shape (names for symbolic dims)."""
    return [{"name": meta.name, "dtype": ort_dtype_name(meta.type), "shape": list(meta.shape)} for meta in metas]


def ort_dtype_name(type_text: str) -> str:
    """numpy's name of an ONNX Runtime type: "tensor(float)" -> "float32"."""
    names = {"float": "float32", "double": "float64"}
    inner = type_text.removeprefix("tensor(").removesuffix(")")
    return names.get(inner, inner)
