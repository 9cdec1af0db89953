"""Runs a few MatMulRelu problems once per path, for Nsight Compute (the run's ncu command is in
ncu.log): the thin-product kernel next to cuBLASLt on the same inputs."""
import sys

import torch

from deploykit import kernels

lib = kernels.load(sys.argv[1])
ws = torch.empty(lib.dk_matmul_relu_cuda_workspace_bytes(), dtype=torch.uint8, device="cuda")
for m, k, n in [(32, 1024, 1024), (64, 8192, 8192), (1, 4096, 4096)]:
    a = torch.randn(m, k, device="cuda").half()
    b = (torch.randn(k, n, device="cuda") / k ** 0.5).half()
    y = torch.empty(m, n, device="cuda").half()
    for path in ("thin", "cublaslt"):
        lib.dk_matmul_relu_cuda_allow_paths(1 << kernels.MATMUL_PATHS[path])
        for _ in range(2):
            assert lib.dk_matmul_relu_cuda(kernels.FLOAT16, a.data_ptr(), b.data_ptr(), None,
                                           y.data_ptr(), m, k, n, 0, ws.data_ptr(), ws.numel(),
                                           torch.cuda.current_stream().cuda_stream) == 0
        torch.cuda.synchronize()
        print(m, k, n, path, lib.dk_matmul_relu_cuda_last_path(), flush=True)
