"""The ONNX Runtime runner: the fallback that runs every bundle, on the CPU or the CUDA EP,
with deploykit's op library registered.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from deploykit.errors import DeployKitError, EnvironmentProblem
from deploykit.bundle.read import Bundle, version_tuple
from deploykit.backends.base.feeds import DeviceArray, Feed, collect_feeds, deliver_host, imported_torch, output_kind
from deploykit.backends.base.memory import TorchMemory
from deploykit.backends.base.runner import Runner

MIN_ORT_FOR_OP_LIBRARY = (1, 21)  # the op library asks ONNX Runtime for API version 21
CUDA_EP = "CUDAExecutionProvider"


class OnnxRuntimeBundleRunner(Runner):
    """An ONNX Runtime session over the bundle's graph, with deploykit's op library registered.

    ``op_library=False`` runs the graph's ONNX function fallbacks instead of our kernels;
    ``model`` swaps in another graph with the same signature (bench's plain export).
    """

    backend = "onnxruntime"

    def __init__(self, bundle: Bundle, device: str = "cpu", device_id: int = 0, *, op_library: bool = True,
                 verify: bool = True, model: Path | None = None, threads: int | None = None,
                 cuda_graph: bool = False, stream: int | None = None, tf32: bool = False,
                 profile_prefix: str | None = None, notes: list[str] | None = None):
        import onnxruntime as ort

        super().__init__(bundle, device, list(notes or []))
        self.ort, self.device_id = ort, device_id
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if threads:
            options.intra_op_num_threads = threads
        if profile_prefix:
            options.enable_profiling, options.profile_file_prefix = True, profile_prefix
        self.library = self._register_library(options, verify) if op_library else None
        if tf32 and device == "cuda":
            options.add_session_config_entry("deploykit.allow_tf32", "1")  # our MatMulRelu kernel
            self.notes.append("TF32 on: fp32 convolutions and matrix products round their inputs to 10 mantissa bits, "
                              "which the bundle's fp32 validation did not cover")
        if op_library is False and bundle.op_library:
            self.notes.append("op library not loaded: deploykit ops run as their ONNX functions")
        self.model_path = Path(model) if model else bundle.file(bundle.manifest.get("model", "model.onnx"), verify)
        self.session = self._session(options, cuda_graph, stream, tf32)
        self.provider = self.session.get_providers()[0]
        self._check_versions()

    def _register_library(self, options, verify: bool) -> Path | None:
        entry = self.bundle.op_library
        if entry is None:
            return None
        if version_tuple(self.ort.__version__) < MIN_ORT_FOR_OP_LIBRARY:
            raise EnvironmentProblem(f"{entry['file']} needs onnxruntime >= 1.21 and this is {self.ort.__version__}: "
                                     "pip install -U onnxruntime, or load(..., op_library=False) for the ONNX functions")
        path = self.bundle.file(entry["file"], verify)
        try:
            options.register_custom_ops_library(str(path))
        except Exception as error:  # noqa: BLE001 - ORT raises its own Fail type
            raise EnvironmentProblem(
                f"onnxruntime {self.ort.__version__} cannot load {path.name} ({str(error).splitlines()[0][:200]}): it was "
                "built for another platform or ORT; re-run deploykit convert here, or pass op_library=False "
                "(--no-op-library) to run the ONNX function fallbacks") from None
        return path

    def _session(self, options, cuda_graph: bool, stream: int | None, tf32: bool):
        providers: list = ["CPUExecutionProvider"]
        if self.device == "cuda":
            # ORT's CUDA EP rounds fp32 Conv/MatMul to TF32 unless told not to; validation was fp32
            cuda_options = {"device_id": str(self.device_id), "use_tf32": "1" if tf32 else "0"}
            if cuda_graph:
                cuda_options["enable_cuda_graph"] = "1"
            if stream is not None:  # run on the caller's stream (a cudaStream_t as an integer)
                cuda_options["user_compute_stream"] = str(stream)
            providers.insert(0, (CUDA_EP, cuda_options))
            if hasattr(self.ort, "preload_dlls"):  # cuDNN/cuBLAS from the NVIDIA wheels
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self.ort.preload_dlls()
        try:
            session = self.ort.InferenceSession(str(self.model_path), options, providers=providers)
        except Exception as error:  # noqa: BLE001
            raise DeployKitError(f"onnxruntime {self.ort.__version__} cannot load {self.model_path.name}: "
                                 f"{str(error).splitlines()[0][:300]}") from None
        if self.device == "cuda" and session.get_providers()[0] != CUDA_EP:
            raise EnvironmentProblem(f"onnxruntime's {CUDA_EP} did not start (missing CUDA/cuDNN libraries or GPU); "
                                     "run deploykit doctor")
        return session

    def _check_versions(self) -> None:
        recorded = self.bundle.recorded_version("onnxruntime-gpu", "onnxruntime")
        if recorded and recorded != self.ort.__version__:
            self._warn(f"validated with onnxruntime {recorded}, running {self.ort.__version__}: "
                              "outputs may differ slightly")

    def describe(self) -> dict:
        return {**super().describe(), "provider": self.provider, "model": self.model_path.name,
                "op_library": self.library.name if self.library else None}

    def run(self, feeds=None, /, **named) -> dict:
        given = collect_feeds(feeds, named, self.inputs)
        kind, device = output_kind(given)
        if self.device == "cuda" and any(feed.on_device for feed in given.values()):
            return self._run_bound(given, kind, device)
        host = {name: feed.host() for name, feed in given.items()}
        values = self.session.run(None, host)
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
        self.session.run_with_iobinding(binding)
        for name, value in zip(self.output_names, binding.get_outputs()):
            if name not in results:
                results[name] = self._deliver_ort_value(value, kind, device)
        return {name: results[name] for name in self.output_names}

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
        array = DeviceArray(value.data_ptr(), value.shape(), _ort_numpy_dtype(value.data_type()), owner=value)
        if kind == "torch":
            return imported_torch().as_tensor(array, device=device)
        return array

    def end_profiling(self) -> str:
        return self.session.end_profiling()


def _ort_numpy_dtype(type_text: str) -> np.dtype:
    names = {"float": "float32", "double": "float64", "float16": "float16", "bool": "bool"}
    inner = type_text.removeprefix("tensor(").removesuffix(")")
    return np.dtype(names.get(inner, inner))
