"""``deploykit.load(bundle)``: run a converted bundle, after checking it is the one deploykit validated.

Loader/runner split: ``open_bundle`` reads the manifest and verifies files against it;
``load`` picks a backend (a TensorRT engine where this GPU can run it, else ONNX Runtime) and
returns a runner; a runner only runs. Runners take numpy arrays, torch tensors (CPU or CUDA)
or ``__cuda_array_interface__`` objects and return outputs by name: torch tensors on the
inputs' device when the inputs were torch tensors, device arrays when they were other CUDA
arrays, numpy otherwise. CUDA inputs are not copied (ONNX Runtime IOBinding, TensorRT tensor
addresses); without torch, device memory comes from cuda-python (``cuda.bindings.runtime``).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path
from typing import Mapping

import numpy as np

from deploykit.bundle import read_manifest, sha256_of
from deploykit.errors import BadInputError, DeployKitError, EnvironmentProblem, ValidationFailed

FORMAT_VERSION = 1
MIN_ORT_FOR_OP_LIBRARY = (1, 21)  # the op library asks ONNX Runtime for API version 21
BACKENDS = ("auto", "onnxruntime", "tensorrt")
CUDA_EP = "CUDAExecutionProvider"
TRT_PIP = {"tensorrt": "tensorrt=={v}", "tensorrt-rtx": "tensorrt-rtx-cu13-libs=={v} tensorrt-rtx-cu13-bindings=={v}"}


# --------------------------------------------------------------------------- the bundle


@dataclasses.dataclass
class Bundle:
    """A bundle directory and its manifest; a file is checked against its sha256 when first used."""

    path: Path
    manifest: dict
    _verified: set = dataclasses.field(default_factory=set, repr=False)

    @property
    def inputs(self) -> list[dict]:
        return self.manifest["inputs"]

    @property
    def outputs(self) -> list[dict]:
        return self.manifest["outputs"]

    @property
    def engines(self) -> list[dict]:
        return self.manifest.get("engines", [])

    @property
    def op_library(self) -> dict | None:
        return next((e for e in self.manifest.get("custom_op_libraries", []) if e["runtime"] == "onnxruntime"), None)

    @property
    def passed(self) -> bool:
        return bool(self.manifest.get("validation", {}).get("passed"))

    def recorded_version(self, *names: str) -> str | None:
        versions = self.manifest.get("versions", {})
        return next((versions[n] for n in names if n in versions), None)

    def file(self, name: str, verify: bool = True) -> Path:
        """Path of a bundle file, refused when it is missing or differs from what was validated."""
        path = self.path / name
        entry = self.manifest.get("files", {}).get(name)
        if entry is None:
            raise BadInputError(f"{name} is not listed in {self.path / 'manifest.json'}: the bundle is damaged; "
                                "re-run deploykit convert")
        if not path.is_file():
            raise BadInputError(f"{path} is missing: the bundle is incomplete; re-run deploykit convert")
        if verify and name not in self._verified:
            if sha256_of(path) != entry["sha256"]:
                raise BadInputError(f"{path} differs from the file deploykit validated (sha256 mismatch with "
                                    "manifest.json): it was changed after conversion; restore it or re-run deploykit convert")
            self._verified.add(name)
        return path


def open_bundle(path: str | Path) -> Bundle:
    """Read a bundle's manifest; refuse directories that are not bundles or are too new for us."""
    manifest = read_manifest(path)
    if manifest.get("format") != "deploykit-bundle":
        raise BadInputError(f"{path}/manifest.json is not a deploykit bundle manifest; run deploykit convert")
    if int(manifest.get("format_version", 0)) > FORMAT_VERSION:
        raise EnvironmentProblem(f"{path} was written by a newer deploykit (bundle format "
                                 f"{manifest['format_version']}, this one reads {FORMAT_VERSION}): pip install -U deploykit")
    return Bundle(Path(path).absolute(), manifest)


def check_validation(bundle: Bundle, allow_failed: bool) -> None:
    """A bundle whose validation failed runs only on request: its outputs are known to be wrong."""
    if not bundle.passed and not allow_failed:
        raise ValidationFailed(f"{bundle.path} failed validation against PyTorch (see its report.html); "
                               "fix the conversion, or pass allow_failed=True (--allow-failed) to run it anyway")


def version_tuple(text: str) -> tuple[int, ...]:
    """Numeric parts of a version, for comparisons: "1.32.0+cu130" -> (1, 32, 0)."""
    parts = []
    for part in text.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class Feed:
    """One input as given: host (numpy view) or device (pointer), and whether it came from torch."""

    name: str
    value: object
    shape: tuple[int, ...]
    dtype: np.dtype
    on_device: bool
    torch_device: str | None = None  # "cpu", "cuda:0"... for torch tensors

    def host(self) -> np.ndarray:
        if not self.on_device:
            return self.value
        if self.torch_device is None:
            raise BadInputError(f"input {self.name} is a CUDA array but this runner runs on the CPU: "
                                "pass a numpy array, or load the bundle with device='cuda'")
        return self.value.cpu().numpy()

    @property
    def pointer(self) -> int:
        if not self.on_device:
            return self.value.ctypes.data
        if self.torch_device is not None:
            return self.value.data_ptr()
        return self.value.__cuda_array_interface__["data"][0]


def _torch():
    return sys.modules.get("torch")  # a torch tensor can only exist when torch is imported


def _torch_dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def as_feed(name: str, value) -> Feed:
    """Classify one input value without copying it (torch CPU tensors become numpy views)."""
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach().contiguous()
        if tensor.dtype == torch.bfloat16:
            raise BadInputError(f"input {name} is bfloat16: deploykit bundles take the dtype in their manifest")
        dtype = np.dtype(_torch_dtype_name(tensor.dtype))
        if tensor.is_cuda:
            return Feed(name, tensor, tuple(tensor.shape), dtype, True, str(tensor.device))
        return Feed(name, tensor.numpy(), tuple(tensor.shape), dtype, False, "cpu")
    interface = getattr(value, "__cuda_array_interface__", None)
    if interface is not None:
        if interface.get("strides") not in (None, _c_strides(interface)):
            raise BadInputError(f"input {name} is a non-contiguous CUDA array: pass a contiguous one")
        return Feed(name, value, tuple(interface["shape"]), np.dtype(interface["typestr"]), True)
    array = np.ascontiguousarray(value)
    return Feed(name, array, array.shape, array.dtype, False)


def _c_strides(interface: dict) -> tuple[int, ...]:
    itemsize, strides, step = np.dtype(interface["typestr"]).itemsize, [], 1
    for dim in reversed(interface["shape"]):
        strides.append(step * itemsize)
        step *= dim
    return tuple(reversed(strides))


def collect_feeds(feeds, named: Mapping, specs: list[dict]) -> dict[str, Feed]:
    """Inputs by name (a dict, keywords, or one bare array for a one-input model), checked."""
    if feeds is not None and not isinstance(feeds, Mapping):
        if len(specs) != 1:
            raise BadInputError(f"the model takes {len(specs)} inputs ({', '.join(s['name'] for s in specs)}): "
                                "pass them by name")
        feeds = {specs[0]["name"]: feeds}
    given = {**(feeds or {}), **named}
    names = [spec["name"] for spec in specs]
    unknown, missing = sorted(set(given) - set(names)), [n for n in names if n not in given]
    if unknown or missing:
        problem = f"no input named {', '.join(unknown)}" if unknown else f"missing {', '.join(missing)}"
        raise BadInputError(f"{problem}; the model takes {describe_inputs(specs)}")
    result = {name: as_feed(name, given[name]) for name in names}
    for spec in specs:
        check_feed(result[spec["name"]], spec)
    return result


def describe_inputs(specs: list[dict]) -> str:
    return ", ".join(f"{s['name']} ({s['dtype']}, {'x'.join(map(str, s['shape']))})" for s in specs)


def check_feed(feed: Feed, spec: dict) -> None:
    """Dtype, rank and static sizes must match the manifest (runtimes report these obscurely)."""
    want = "x".join(map(str, spec["shape"]))
    if feed.dtype != np.dtype(spec["dtype"]):
        raise BadInputError(f"input {feed.name} is {feed.dtype}, the model takes {spec['dtype']}: convert it first "
                            f"(e.g. x.astype(numpy.{spec['dtype']}))")
    if len(feed.shape) != len(spec["shape"]) or any(
        isinstance(d, int) and d > 0 and d != g for d, g in zip(spec["shape"], feed.shape)
    ):
        raise BadInputError(f"input {feed.name} has shape {'x'.join(map(str, feed.shape))}, the model takes {want}")


def check_batch_range(feed: Feed, spec: dict) -> None:
    """Engines accept only the batch range they were built for."""
    batch = spec.get("dynamic", {}).get("0")
    if batch and not batch["min"] <= feed.shape[0] <= batch["max"]:
        raise BadInputError(f"input {feed.name} has batch {feed.shape[0]}; the engine accepts "
                            f"{batch['min']}..{batch['max']} (convert with a wider --batch)")


def batch_sizes(specs: list[dict]) -> tuple[int, int, int] | None:
    """(min, opt, max) of the dynamic batch the bundle was converted with, None when static."""
    batch = specs[0].get("dynamic", {}).get("0") if specs else None
    return (batch["min"], batch["opt"], batch["max"]) if batch else None


def random_inputs(specs: list[dict], batch: int | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random inputs at ``batch`` (default: the optimum of a dynamic batch)."""
    from deploykit.feeds import random_feeds
    from deploykit.specs import InputSpec

    dynamic = batch_sizes(specs)
    batch = batch or (dynamic[1] if dynamic else None)
    shapes = []
    for spec in specs:
        dims = [d if isinstance(d, int) and d > 0 else None for d in spec["shape"]]
        if batch is not None and dims:
            dims[0] = batch
        if any(d is None for d in dims):
            raise BadInputError(f"input {spec['name']} has dynamic sizes {spec['shape']}: give inputs as .npz (--inputs)")
        shapes.append(InputSpec(spec["name"], tuple(dims), spec["dtype"]))
    return random_feeds(shapes, seed)


def bundle_feeds(specs: list[dict], path: Path | None, batch: int | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for a bundle: a user's .npz (arrays cast to the model's dtypes) or random ones."""
    if path is None:
        return random_inputs(specs, batch, seed)
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as error:
        raise BadInputError(f"--inputs {path}: cannot read it as .npz ({error}); save with numpy.savez") from None
    missing = [spec["name"] for spec in specs if spec["name"] not in arrays]
    if missing:
        raise BadInputError(f"--inputs {path} lacks {', '.join(missing)} (it holds {', '.join(arrays) or 'nothing'}); "
                            f"the model takes {describe_inputs(specs)}")
    return {spec["name"]: arrays[spec["name"]].astype(spec["dtype"], copy=False) for spec in specs}


# --------------------------------------------------------------------------- outputs


class DeviceArray:
    """A CUDA buffer owned by the runtime (cuda-python or an OrtValue), shared through
    ``__cuda_array_interface__`` so CuPy, Numba or torch can wrap it without a copy."""

    def __init__(self, pointer: int, shape, dtype, owner=None, free=None):
        self.pointer, self.shape, self.dtype = int(pointer), tuple(int(d) for d in shape), np.dtype(dtype)
        self._owner, self._free = owner, free

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.pointer, False),
                "strides": None, "version": 3}

    def __del__(self):
        if self._free is not None:
            self._free(self.pointer)


def output_kind(feeds: dict[str, Feed]) -> tuple[str, str | None]:
    """What run() returns: ("torch", device) for torch inputs, ("device", None) for other CUDA
    arrays, ("numpy", None) otherwise."""
    for feed in feeds.values():
        if feed.torch_device is not None:
            return "torch", feed.torch_device
    if any(feed.on_device for feed in feeds.values()):
        return "device", None
    return "numpy", None


def deliver_host(array: np.ndarray, kind: str, device: str | None):
    """A host output in the form the caller gave its inputs."""
    if kind == "torch":
        tensor = _torch().from_numpy(np.ascontiguousarray(array))
        return tensor if device == "cpu" else tensor.to(device)
    if kind == "device":
        raise BadInputError("CUDA-array inputs need a CUDA runner: load the bundle with device='cuda'")
    return array


# --------------------------------------------------------------------------- device memory


def _cudart():
    """cuda-python's runtime bindings (``cuda.bindings.runtime``; ``cuda.cudart`` before 12.6)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime
        except ImportError:
            raise EnvironmentProblem("running an engine without torch needs cuda-python for device memory: "
                                     "pip install cuda-python (or install a CUDA build of torch)") from None
    return runtime


def _cuda_check(result, what: str):
    """Unpack cuda-python's (error, value...) tuples, raising on an error."""
    error, *values = result if isinstance(result, tuple) else (result,)
    if int(error) != 0:
        name = getattr(error, "name", str(error))
        raise EnvironmentProblem(f"CUDA {what} failed: {name}; run deploykit doctor to check the driver and GPU")
    return values[0] if len(values) == 1 else values


class CudaPythonMemory:
    """Device buffers, copies and a stream from cuda-python: engines run without torch."""

    name = "cuda-python"

    def __init__(self, device_id: int):
        self.rt = _cudart()
        _cuda_check(self.rt.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")
        self._stream = _cuda_check(self.rt.cudaStreamCreate(), "cudaStreamCreate")

    def stream(self) -> int:
        return int(self._stream)

    def empty(self, shape, dtype) -> DeviceArray:
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
        pointer = _cuda_check(self.rt.cudaMalloc(nbytes), f"cudaMalloc({nbytes})")
        return DeviceArray(int(pointer), shape, dtype, free=self._free)

    def _free(self, pointer: int) -> None:
        self.rt.cudaFree(pointer)

    def to_device(self, array: np.ndarray) -> DeviceArray:
        buffer = self.empty(array.shape, array.dtype)
        kind = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        _cuda_check(self.rt.cudaMemcpyAsync(buffer.pointer, array.ctypes.data, array.nbytes, kind, self._stream),
                    "cudaMemcpyAsync")
        self.synchronize()  # the host array may be freed once we return
        return buffer

    def to_host(self, buffer: DeviceArray) -> np.ndarray:
        array = np.empty(buffer.shape, buffer.dtype)
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        _cuda_check(self.rt.cudaMemcpyAsync(array.ctypes.data, buffer.pointer, buffer.nbytes, kind, self._stream),
                    "cudaMemcpyAsync")
        self.synchronize()
        return array

    def synchronize(self) -> None:
        _cuda_check(self.rt.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def deliver(self, buffer: DeviceArray, kind: str, device: str | None):
        return buffer if kind == "device" else deliver_host(self.to_host(buffer), kind, device)


class TorchMemory:
    """Device buffers from torch's caching allocator, on torch's current stream, so outputs
    returned as CUDA tensors need no synchronisation."""

    name = "torch"

    def __init__(self, device_id: int):
        import torch

        if not torch.cuda.is_available():
            raise EnvironmentProblem(f"torch {torch.__version__} sees no CUDA GPU (CUDA build: "
                                     f"{torch.version.cuda}); run deploykit doctor")
        self.torch, self.device = torch, torch.device("cuda", device_id)

    def stream(self) -> int:
        return self.torch.cuda.current_stream(self.device).cuda_stream

    def empty(self, shape, dtype):
        return self.torch.empty(tuple(shape), dtype=getattr(self.torch, np.dtype(dtype).name), device=self.device)

    def to_device(self, array: np.ndarray):
        return self.torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def synchronize(self) -> None:
        self.torch.cuda.current_stream(self.device).synchronize()

    def deliver(self, tensor, kind: str, device: str | None):
        if kind == "torch":
            return tensor if device != "cpu" else tensor.cpu()
        if kind == "device":
            return tensor
        return tensor.cpu().numpy()


def device_memory(device_id: int):
    """torch's allocator when torch is already imported with CUDA, else cuda-python, else torch."""
    torch = _torch()
    if torch is not None and torch.cuda.is_available():
        return TorchMemory(device_id)
    try:
        return CudaPythonMemory(device_id)
    except EnvironmentProblem as problem:
        try:
            import torch  # noqa: F401
        except ImportError:
            raise problem from None
        return TorchMemory(device_id)


# --------------------------------------------------------------------------- runners


class Runner:
    """Common surface: ``run(feeds)`` / ``runner(x=...)`` -> {output name: array}."""

    backend = "?"

    def __init__(self, bundle: Bundle, device: str, notes: list[str]):
        self.bundle, self.device, self.notes = bundle, device, notes
        self.warnings: list[str] = []  # the notes load() also issues as warnings: what differs from conversion
        self.inputs, self.outputs = bundle.inputs, bundle.outputs
        self.input_names = [spec["name"] for spec in self.inputs]
        self.output_names = [spec["name"] for spec in self.outputs]

    def run(self, feeds=None, /, **named) -> dict:
        raise NotImplementedError

    def __call__(self, feeds=None, /, **named) -> dict:
        return self.run(feeds, **named)

    def describe(self) -> dict:
        return {"bundle": str(self.bundle.path), "backend": self.backend, "device": self.device, "notes": self.notes}

    def _warn(self, note: str) -> None:
        self.notes.append(note)
        self.warnings.append(note)

    def close(self) -> None:
        """Release what the runner holds; runners also work without calling it."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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
        shapes = self._output_shapes(given)
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

    def _output_shapes(self, given: dict[str, Feed]) -> list[tuple[int, ...] | None]:
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
            return _torch().as_tensor(array, device=device)
        return array

    def end_profiling(self) -> str:
        return self.session.end_profiling()


def _ort_numpy_dtype(type_text: str) -> np.dtype:
    names = {"float": "float32", "double": "float64", "float16": "float16", "bool": "bool"}
    inner = type_text.removeprefix("tensor(").removesuffix(")")
    return np.dtype(names.get(inner, inner))


class TensorRTBundleRunner(Runner):
    """The bundle's TensorRT engine (plugins embedded) on this GPU, fed by device pointer."""

    backend = "tensorrt"

    def __init__(self, bundle: Bundle, entry: dict, device_id: int = 0, *, verify: bool = True,
                 notes: list[str] | None = None):
        from deploykit.backends import tensorrt

        super().__init__(bundle, "cuda", list(notes or []))
        problem = engine_problem(entry, installed_tensorrt(entry["flavour"]), tensorrt.local_gpus())
        if problem:
            raise EnvironmentProblem(f"cannot run {entry['file']} here: {problem}")
        if not entry.get("validated"):
            self._warn(f"{entry['file']} was not run at conversion time ({entry.get('note', '')}); "
                              "its outputs were validated only through ONNX Runtime")
        self.entry, self.flavour = entry, tensorrt.load_tensorrt(entry["flavour"])
        self.memory = device_memory(device_id)
        path = bundle.file(entry["file"], verify)
        self._runtime, self.engine = tensorrt._deserialize(self.flavour, path.read_bytes())
        self._cache, self._cache_path = None, None
        self.context = self._create_context(tensorrt, entry)

    def _create_context(self, tensorrt, entry: dict):
        if not self.flavour.is_rtx:
            return self.engine.create_execution_context()
        from deploykit import native  # RTX compiles kernels on first run: keep them across runs

        config = self.engine.create_runtime_config()
        self._cache_path = native.cache_dir() / "runtime-cache" / f"{self.bundle.manifest['files'][entry['file']]['sha256'][:16]}.bin"
        self._cache = config.create_runtime_cache()
        if self._cache_path.is_file():
            self._cache.deserialize(self._cache_path.read_bytes())
        config.set_runtime_cache(self._cache)
        return self.engine.create_execution_context(config)

    def describe(self) -> dict:
        return {**super().describe(), "engine": self.entry["file"], "tensorrt": self.flavour.label,
                "memory": self.memory.name}

    def _dtype(self, name: str) -> np.dtype:
        return np.dtype(self.flavour.module.nptype(self.engine.get_tensor_dtype(name)))

    def run(self, feeds=None, /, **named) -> dict:
        given = collect_feeds(feeds, named, self.inputs)
        for spec in self.inputs:
            check_batch_range(given[spec["name"]], spec)
        kind, device = output_kind(given)
        keep = []  # device copies of host inputs live until the engine has run
        for name, feed in given.items():
            buffer = feed.value if feed.on_device else self.memory.to_device(feed.host())
            keep.append(buffer)
            self.context.set_input_shape(name, feed.shape)
            self.context.set_tensor_address(name, feed.pointer if feed.on_device else _pointer(buffer))
        outputs = {}
        for name in self.output_names:
            outputs[name] = self.memory.empty(tuple(self.context.get_tensor_shape(name)), self._dtype(name))
            self.context.set_tensor_address(name, _pointer(outputs[name]))
        if not self.context.execute_async_v3(self.memory.stream()):
            from deploykit.backends import tensorrt

            errors, _ = tensorrt._logger(self.flavour).take()
            raise DeployKitError(f"{self.flavour.label} failed to run {self.entry['file']}: {'; '.join(errors)}")
        if kind != "torch":
            self.memory.synchronize()
        return {name: self.memory.deliver(buffer, kind, device) for name, buffer in outputs.items()}

    def close(self) -> None:
        if self._cache is not None:
            self._cache_path.parent.mkdir(parents=True, exist_ok=True)
            self._cache_path.write_bytes(bytes(self._cache.serialize()))


def _pointer(buffer) -> int:
    return buffer.pointer if isinstance(buffer, DeviceArray) else buffer.data_ptr()


# --------------------------------------------------------------------------- choosing a backend


def installed_tensorrt(flavour: str) -> tuple[str | None, tuple[str, ...] | None]:
    """(version, RTX's supported compute capabilities or None) of an installed flavour; (None, None) if absent."""
    from deploykit.backends import tensorrt

    try:
        module = tensorrt.load_tensorrt(flavour)
    except EnvironmentProblem:
        return None, None
    return module.version, tensorrt.rtx_targets(module) if module.is_rtx else None


def engine_problem(entry: dict, installed: tuple[str | None, tuple[str, ...] | None], gpus) -> str | None:
    """Why this machine cannot run a bundle's engine (None: it can). Pure, for doctor and tests.

    ``installed`` is ``installed_tensorrt(flavour)``; ``gpus`` is ``tensorrt.local_gpus()``:
    ((name, "major.minor"), ...) or the reason there is no GPU.
    """
    flavour, built = entry["flavour"], entry["version"]
    label = "TensorRT-RTX" if flavour == "tensorrt-rtx" else "TensorRT"
    version, rtx_targets = installed
    install = TRT_PIP[flavour].format(v=built)
    if version is None:
        return f"{label} is not installed: pip install {install}"
    if version != built:
        return (f"it was built with {label} {built} and this machine has {version}; engines run on the version "
                f"that built them: pip install {install}, or re-run deploykit convert --backend tensorrt here")
    if isinstance(gpus, str) or not gpus:
        return f"{label} engines need an NVIDIA GPU and {gpus or 'there is none'}"
    name, capability = gpus[0]
    if rtx_targets is not None and capability not in rtx_targets:
        return (f"{label} does not run on compute capability {capability} ({name}); it supports "
                f"{', '.join(rtx_targets)}: install full TensorRT (pip install tensorrt) and convert with it here")
    if capability not in entry.get("targets", []):
        return (f"the engine was built for compute capability {', '.join(entry.get('targets', []))} and this "
                f"{name} is {capability}: convert with --trt-targets {capability}")
    return None


def parse_device(device: str) -> tuple[str, int]:
    kind, _, index = device.partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise BadInputError(f"device {device!r}: use auto, cpu, cuda or cuda:N")
    return kind, int(index or 0)


def ort_has_cuda() -> bool:
    import onnxruntime as ort

    return CUDA_EP in ort.get_available_providers()


def choose_backend(bundle: Bundle, backend: str, device: str) -> tuple[str, str, list[str]]:
    """(backend, device, notes): an engine on the GPU when it can run here, else ONNX Runtime."""
    if backend not in BACKENDS:
        raise BadInputError(f"backend {backend!r}: use one of {', '.join(BACKENDS)}")
    notes: list[str] = []
    if backend in ("auto", "tensorrt") and device != "cpu":
        if not bundle.engines:
            if backend == "tensorrt":
                raise BadInputError(f"{bundle.path} has no TensorRT engine: convert with --backend tensorrt")
        else:
            from deploykit.backends import tensorrt

            entry = bundle.engines[0]
            problem = engine_problem(entry, installed_tensorrt(entry["flavour"]), tensorrt.local_gpus())
            if problem is None:
                return "tensorrt", "cuda", notes
            if backend == "tensorrt":
                raise EnvironmentProblem(f"cannot run {entry['file']} here: {problem}")
            notes.append(f"TensorRT engine not used: {problem}")
    if backend == "tensorrt":
        raise BadInputError("TensorRT runs on the GPU only: use device='cuda' (or backend='onnxruntime')")
    if device == "auto":
        device = "cuda" if ort_has_cuda() and _has_gpu() else "cpu"
    elif device == "cuda" and not ort_has_cuda():
        import onnxruntime as ort

        raise EnvironmentProblem(f"onnxruntime {ort.__version__} has no {CUDA_EP}: pip uninstall onnxruntime && "
                                 "pip install onnxruntime-gpu (or use device='cpu')")
    return "onnxruntime", device, notes


def _has_gpu() -> bool:
    from deploykit.backends import tensorrt

    return not isinstance(tensorrt.local_gpus(), str)


def load(bundle: str | Path, backend: str = "auto", device: str = "auto", *, allow_failed: bool = False,
         op_library: bool = True, verify: bool = True, **options) -> Runner:
    """Open a bundle and return a runner for it.

    ``backend``: auto (the engine where this GPU runs it, else ONNX Runtime), onnxruntime or
    tensorrt. ``device``: auto, cpu, cuda or cuda:N. Files are checked against the manifest's
    sha256 (``verify=False`` skips it); a bundle that failed validation raises
    ValidationFailed unless ``allow_failed``. ``options`` go to the runner (ONNX Runtime:
    threads, cuda_graph, stream, tf32, profile_prefix). Why a backend was chosen and what differs from the
    conversion machine are in ``runner.notes``; the latter are also issued as warnings.
    """
    opened = open_bundle(bundle)
    check_validation(opened, allow_failed)
    kind, device_id = parse_device(device)
    chosen, kind, notes = choose_backend(opened, backend, kind)
    if chosen == "tensorrt":
        if options:
            raise BadInputError(f"{', '.join(options)} apply to ONNX Runtime only; this bundle runs its TensorRT engine")
        runner = TensorRTBundleRunner(opened, opened.engines[0], device_id, verify=verify, notes=notes, **options)
    else:
        runner = OnnxRuntimeBundleRunner(opened, kind, device_id, op_library=op_library, verify=verify,
                                         notes=notes, **options)
    for note in runner.warnings:
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    return runner
