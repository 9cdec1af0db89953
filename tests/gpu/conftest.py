"""GPU tests: load the CUDA libraries onnxruntime-gpu needs (cuDNN, cuBLAS) from the
NVIDIA wheels next to torch, as ``onnxruntime.preload_dlls`` is documented to do."""

import onnxruntime

if "CUDAExecutionProvider" in onnxruntime.get_available_providers() and hasattr(onnxruntime, "preload_dlls"):
    onnxruntime.preload_dlls()
