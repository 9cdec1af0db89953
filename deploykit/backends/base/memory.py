"""Device memory for CUDA inputs and outputs: torch's caching allocator when torch is there,
else cuda-python, so that engines also run without torch.
"""

from __future__ import annotations

import numpy as np

from deploykit.errors import EnvironmentProblem
from deploykit.backends.base.feeds import DeviceArray, deliver_host, imported_torch


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
        return torch_from_host(array).to(self.device)

    def synchronize(self) -> None:
        self.torch.cuda.current_stream(self.device).synchronize()

    @staticmethod
    def delivers_as_is(kind: str, device: str | None) -> bool:
        """Whether ``deliver`` hands a CUDA tensor over as it is (torch CUDA inputs, CUDA arrays):
        a caller with many outputs then need not call it for each."""
        return kind == "device" or (kind == "torch" and device != "cpu")

    def deliver(self, tensor, kind: str, device: str | None):
        if self.delivers_as_is(kind, device):
            return tensor
        return tensor.cpu() if kind == "torch" else torch_to_host(tensor)


def torch_from_host(array: np.ndarray):
    """A CPU torch tensor sharing a host array's memory (ml_dtypes' bfloat16 too, which torch cannot read)."""
    import torch

    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":  # move the bits
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def torch_to_host(tensor) -> np.ndarray:
    """A torch tensor (CPU or CUDA) as numpy; bfloat16 through ml_dtypes, as numpy has no bfloat16."""
    import torch

    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
    return tensor.cpu().numpy()


def device_memory(device_id: int):
    """torch's allocator when torch is already imported with CUDA, else cuda-python, else torch."""
    torch = imported_torch()
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
