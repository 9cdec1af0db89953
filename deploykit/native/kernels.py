"""ctypes access to deploykit's kernel library (``libdeploykit_kernels.so``, C ABI in
``csrc/kernels/include/deploykit/kernels.h``; op specs in ``docs/ops.md``).

``load()`` opens the library (a path, or ``$DEPLOYKIT_KERNELS_LIB``); ``fused_batch_norm_cpu``
and ``matmul_relu_cpu`` run the CPU kernels on numpy arrays. bfloat16 arrays are either
``ml_dtypes.bfloat16`` or ``uint16`` bit patterns. ``build_library()`` compiles the library alone
with native/build.py's CMake recipe (used by the tests and benchmarks). The CUDA entry points are
declared on the loaded library for callers that hold device pointers (e.g. ``torch.Tensor.data_ptr()``).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from deploykit.native import build as native_build

ENV_VAR = "DEPLOYKIT_KERNELS_LIB"
LIBRARY_NAME = native_build.LIBRARIES["kernels"]

OK, INVALID_ARGUMENT, CUDA_ERROR, CUBLAS_ERROR, NOT_COMPILED = range(5)
FLOAT32, FLOAT16, BFLOAT16 = range(3)
ACTIVATIONS = {"none": 0, "relu": 1}

_loaded: dict[str, ctypes.CDLL] = {}
_default: ctypes.CDLL | None = None


class KernelError(RuntimeError):
    """A kernel returned a status other than DK_OK; ``status`` holds the code."""

    def __init__(self, function: str, status: int, message: str):
        super().__init__(f"{function} failed: {message} (status {status})")
        self.status = status


def _declare(lib: ctypes.CDLL) -> None:
    vp, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    signatures = {
        "dk_status_string": (ctypes.c_char_p, [c_int]),
        "dk_fused_batch_norm_cpu": (c_int, [c_int, vp, vp, vp, vp, i64, i64, i64, c_int]),
        "dk_fused_batch_norm_cuda": (c_int, [c_int, vp, vp, vp, vp, i64, i64, i64, c_int, vp]),
        "dk_matmul_relu_cpu": (c_int, [c_int, vp, vp, vp, vp, i64, i64, i64]),
        "dk_matmul_relu_cuda": (
            c_int, [c_int, vp, vp, vp, vp, i64, i64, i64, c_int, vp, ctypes.c_size_t, vp]),
        "dk_matmul_relu_cuda_workspace_bytes": (ctypes.c_size_t, []),
        "dk_matmul_relu_cuda_last_path": (c_int, []),
        "dk_cublaslt_available": (c_int, []),
        "dk_matmul_relu_cuda_force_fallback": (None, [c_int]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes


def load(path: str | os.PathLike | None = None) -> ctypes.CDLL:
    """Open the kernel library at ``path`` (else ``$DEPLOYKIT_KERNELS_LIB``), once per path.

    The library opened last becomes the default of the wrappers below.
    """
    global _default
    if path is None:
        if _default is not None:
            return _default
        path = os.environ.get(ENV_VAR)
        if not path:
            raise FileNotFoundError(
                f"no kernel library given: pass a path or set {ENV_VAR} to {LIBRARY_NAME}")
    key = str(Path(path).resolve())
    if key not in _loaded:
        lib = ctypes.CDLL(key)
        _declare(lib)
        _loaded[key] = lib
    _default = _loaded[key]
    return _default


def status_string(status: int, lib: ctypes.CDLL | None = None) -> str:
    return (lib or load()).dk_status_string(status).decode()


def check(status: int, function: str, lib: ctypes.CDLL | None = None) -> None:
    """Raise KernelError unless ``status`` is DK_OK."""
    if status != OK:
        raise KernelError(function, status, status_string(status, lib))


def _dtype_code(array: np.ndarray) -> int:
    if array.dtype == np.float32:
        return FLOAT32
    if array.dtype == np.float16:
        return FLOAT16
    if array.dtype == np.uint16 or array.dtype.name == "bfloat16":
        return BFLOAT16
    raise TypeError(f"unsupported dtype {array.dtype}: use float32, float16 or bfloat16 "
                    "(ml_dtypes.bfloat16, or uint16 bit patterns)")


def _operand(array: np.ndarray, name: str, code: int) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy array")
    if _dtype_code(array) != code:
        raise TypeError(f"{name} has dtype {array.dtype}, expected the first operand's dtype")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return array


def _output(out: np.ndarray | None, like: np.ndarray, shape: tuple, code: int) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype=like.dtype)
    _operand(out, "out", code)
    if out.shape != shape:
        raise ValueError(f"out has shape {out.shape}, expected {shape}")
    if not out.flags.writeable:
        raise ValueError("out is read-only")
    return out


def fused_batch_norm_cpu(x: np.ndarray, scale: np.ndarray, bias: np.ndarray,
                         activation: str = "none", *, out: np.ndarray | None = None,
                         lib: ctypes.CDLL | None = None) -> np.ndarray:
    """FusedBatchNorm: ``act(x * scale[c] + bias[c])`` over x of shape (N, C, ...).

    ``out`` (optional, may be ``x`` itself) receives the result; returns it.
    """
    lib = lib or load()
    code = _dtype_code(x)
    _operand(x, "x", code)
    if x.ndim < 2:
        raise ValueError(f"x must have rank >= 2 (N, C, ...), got shape {x.shape}")
    batch, channels = x.shape[0], x.shape[1]
    spatial = int(np.prod(x.shape[2:], dtype=np.int64))
    for name, param in (("scale", scale), ("bias", bias)):
        _operand(param, name, code)
        if param.shape != (channels,):
            raise ValueError(f"{name} has shape {param.shape}, expected ({channels},)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    y = _output(out, x, x.shape, code)
    status = lib.dk_fused_batch_norm_cpu(code, x.ctypes.data, scale.ctypes.data,
                                         bias.ctypes.data, y.ctypes.data, batch, channels,
                                         spatial, ACTIVATIONS[activation])
    check(status, "dk_fused_batch_norm_cpu", lib)
    return y


def matmul_relu_cpu(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None, *,
                    out: np.ndarray | None = None,
                    lib: ctypes.CDLL | None = None) -> np.ndarray:
    """MatMulRelu: ``max(a @ b + bias, 0)``; a is (..., M, K), b is (K, N), bias (N,) or None.

    Returns ``out`` (shape (..., M, N)) if given, else a new array.
    """
    lib = lib or load()
    code = _dtype_code(a)
    _operand(a, "a", code)
    _operand(b, "b", code)
    if a.ndim < 2 or b.ndim != 2 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"shapes {a.shape} and {b.shape} do not fit (..., M, K) @ (K, N)")
    k, n = b.shape
    m = int(np.prod(a.shape[:-1], dtype=np.int64))
    if bias is not None:
        _operand(bias, "bias", code)
        if bias.shape != (n,):
            raise ValueError(f"bias has shape {bias.shape}, expected ({n},)")
    y = _output(out, a, a.shape[:-1] + (n,), code)
    status = lib.dk_matmul_relu_cpu(code, a.ctypes.data, b.ctypes.data,
                                    None if bias is None else bias.ctypes.data, y.ctypes.data,
                                    m, k, n)
    check(status, "dk_matmul_relu_cpu", lib)
    return y


def build_library(build_dir: str | os.PathLike, *, cuda_architectures: str | None = None,
                  cublas_include_dir: str | None = None, jobs: int = 2) -> Path:
    """Build deploykit_kernels alone into ``build_dir``, configured as ``deploykit build-plugins``
    configures ``csrc/`` (without the plugins' headers); return the library's path.

    Needs a source checkout (csrc/ beside this package). CUDA sources compile when nvcc is found.
    """
    build_dir = Path(build_dir)
    cublas = Path(cublas_include_dir) if cublas_include_dir else native_build.cublas_headers()[0]
    headers = native_build.Headers(onnxruntime=None, tensorrt=None, cublas=cublas, problems={})
    native_build.build_target(build_dir, "deploykit_kernels", headers, native_build.cuda_archs(cuda_architectures),
                              jobs)
    library = native_build.built_libraries(build_dir).get("kernels")
    if library is None:
        raise FileNotFoundError(f"{LIBRARY_NAME} not found under {build_dir} after the build")
    return library
