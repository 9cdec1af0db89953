"""``deploykit.load(bundle)``: run a converted bundle, after checking it is the one deploykit validated.

``open_bundle`` reads the manifest and verifies files against it; ``load`` picks a backend (a
TensorRT engine where this GPU can run it, else ONNX Runtime) and returns a runner; a runner
only runs. Runners take numpy arrays, torch tensors (CPU or CUDA) or
``__cuda_array_interface__`` objects and return outputs by name: torch tensors on the inputs'
device when the inputs were torch tensors, device arrays when they were other CUDA arrays,
numpy otherwise. CUDA inputs are not copied (ONNX Runtime IOBinding, TensorRT tensor
addresses); without torch, device memory comes from cuda-python (``cuda.bindings.runtime``).

Where things live: ``deploykit.bundle`` (opening and verifying a bundle), ``deploykit.backends``
(``base``: the runner contract, feeds and outputs, device memory; ``onnxruntime`` and
``tensorrt``: loaders, runners, and each backend's bundle loader; ``tensorrt.compat``: whether
an engine can run here; ``aoti``: AOTInductor packages, ``aoti.compat``: whether a package runs here), ``runtime.choose`` (the backend choice and ``load``). Heavy libraries
(torch, onnxruntime, tensorrt, cuda-python) are imported only when used.
"""

from deploykit.bundle.read import Bundle, check_validation, open_bundle, version_tuple
from deploykit.runtime.choose import has_gpu, load, ort_has_cuda, parse_device
from deploykit.backends.base.feeds import DeviceArray, Feed, as_feed, batch_sizes, bundle_feeds, collect_feeds, random_inputs
from deploykit.backends.aoti.bundle import load_aoti
from deploykit.backends.aoti.compat import package_problem, package_problem_here
from deploykit.backends.aoti.runner import AotiRunner
from deploykit.backends.base.memory import CudaPythonMemory, TorchMemory
from deploykit.backends.base.runner import Runner
from deploykit.backends.onnxruntime.bundle import load_onnxruntime
from deploykit.backends.onnxruntime.loader import CUDA_EP, MIN_ORT_FOR_OP_LIBRARY
from deploykit.backends.onnxruntime.runner import OnnxRuntimeRunner
from deploykit.backends.tensorrt.bundle import load_tensorrt_engine
from deploykit.backends.tensorrt.compat import engine_problem, engine_problem_here
from deploykit.backends.tensorrt.runner import TensorRTRunner
from deploykit.backends.tensorrt.shim import installed_tensorrt

__all__ = [
    "CUDA_EP", "MIN_ORT_FOR_OP_LIBRARY", "AotiRunner", "Bundle", "CudaPythonMemory", "DeviceArray", "Feed",
    "OnnxRuntimeRunner", "Runner", "TensorRTRunner", "TorchMemory", "as_feed", "batch_sizes",
    "bundle_feeds", "check_validation", "collect_feeds", "engine_problem", "engine_problem_here", "has_gpu",
    "installed_tensorrt", "load", "load_aoti", "load_onnxruntime", "load_tensorrt_engine", "open_bundle", "ort_has_cuda",
    "package_problem", "package_problem_here", "parse_device", "random_inputs", "version_tuple",
]
