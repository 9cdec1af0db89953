"""Times the CUDA kernels on the current GPU (needs torch with CUDA; not a test).

    python csrc/kernels/bench/bench_cuda.py [path/to/libdeploykit_kernels.so]

Without a path it builds the library for this GPU under /tmp/dk-bench. Prints FusedBatchNorm
bandwidth (bytes read + written over time) next to a device-to-device copy, and MatMulRelu
TFLOP/s through cuBLASLt and the fallback kernel next to torch's relu(addmm).
"""

from __future__ import annotations

import sys

import torch

from deploykit import kernels

CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def bench(fn, reps=50) -> float:
    """Median milliseconds of fn() over `reps` runs, timed with CUDA events."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    if len(sys.argv) > 1:
        lib = kernels.load(sys.argv[1])
    else:
        major, minor = torch.cuda.get_device_capability()
        lib = kernels.load(kernels.build_library("/tmp/dk-bench",
                                                 cuda_architectures=f"{major}{minor}"))
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    print(torch.cuda.get_device_name(), "cuBLASLt loaded:", lib.dk_cublaslt_available())

    print("\nFusedBatchNorm (relu)           ms     GB/s   copy GB/s")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for shape, offset in (((64, 512, 56 * 56), 0), ((64, 512, 56 * 56), 1),
                              ((2048, 1024, 7 * 7), 0), ((16384, 6272, 1), 0),
                              ((8, 64, 112 * 112), 0)):
            numel = shape[0] * shape[1] * shape[2]
            xb = torch.randn(numel + offset, device="cuda").to(dtype)
            x = xb[offset:]
            y = torch.empty_like(xb)[offset:]
            s = torch.randn(shape[1], device="cuda").to(dtype)
            b = torch.randn(shape[1], device="cuda").to(dtype)

            def run():
                st = lib.dk_fused_batch_norm_cuda(CODE[dtype], x.data_ptr(), s.data_ptr(),
                                                  b.data_ptr(), y.data_ptr(), *shape, 1, stream())
                assert st == 0, st

            ms = bench(run)
            copy_ms = bench(lambda: y.copy_(x))
            gbs = 2 * x.numel() * x.element_size() / ms / 1e6
            copy_gbs = 2 * x.numel() * x.element_size() / copy_ms / 1e6
            print(f"{str(dtype)[6:]:9} {str(shape):20} off={offset} {ms:7.3f} {gbs:8.0f} "
                  f"{copy_gbs:8.0f}")

    print("\nMatMulRelu (bias)            cuBLASLt TFLOP/s  fallback TFLOP/s  torch TFLOP/s")
    ws = torch.empty(lib.dk_matmul_relu_cuda_workspace_bytes(), dtype=torch.uint8, device="cuda")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for m, k, n in ((4096, 4096, 4096), (8192, 1024, 1024), (64, 4096, 4096),
                        (1000, 1000, 1000)):
            a = torch.randn(m, k, device="cuda").to(dtype)
            bmat = torch.randn(k, n, device="cuda").to(dtype)
            bias = torch.randn(n, device="cuda").to(dtype)
            y = torch.empty(m, n, device="cuda", dtype=dtype)

            def run():
                st = lib.dk_matmul_relu_cuda(CODE[dtype], a.data_ptr(), bmat.data_ptr(),
                                             bias.data_ptr(), y.data_ptr(), m, k, n, 0,
                                             ws.data_ptr(), ws.numel(), stream())
                assert st == 0, st

            flop = 2 * m * k * n
            results = []
            for force in (0, 1):
                lib.dk_matmul_relu_cuda_force_fallback(force)
                ms = bench(run, reps=10 if force else 30)
                results.append((flop / ms / 1e9, lib.dk_matmul_relu_cuda_last_path()))
            lib.dk_matmul_relu_cuda_force_fallback(0)
            torch_ms = bench(lambda: torch.relu(torch.addmm(bias, a, bmat)), reps=30)
            print(f"{str(dtype)[6:]:9} {m:5}x{k:5}x{n:5}  {results[0][0]:8.1f} (path "
                  f"{results[0][1]})  {results[1][0]:8.1f} (path {results[1][1]})  "
                  f"{flop / torch_ms / 1e9:8.1f}")


if __name__ == "__main__":
    main()
