"""deploykit MatMulRelu (dk_matmul_relu_cuda, behind deploykit::MatMulRelu) against PyTorch.

    python benchmarks/bench_matmul_relu.py [--lib libdeploykit_kernels.so] [--out mm.md]

y = relu(a @ b [+ bias]) for a (m, k), b (k, n). PyTorch's side is torch.relu(a @ b), or
torch.relu(torch.addmm(bias, a, b)) with a bias, in the same run; its product alone (a @ b or
addmm, no ReLU) is timed too, to show what the separate ReLU costs. fp32 runs with and without
TF32 (torch.backends.cuda.matmul.allow_tf32 and our allow_tf32 alike). Times are medians over
CUDA-graph replays timed with CUDA events, input sets rotating through 3x L2 (timing.py).
cuBLASLt is loaded from the nvidia-cublas wheel next to torch unless DEPLOYKIT_CUBLASLT_LIB is set.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import timing  # noqa: E402
from deploykit.native import kernels  # noqa: E402

CODE = {torch.float32: kernels.FLOAT32, torch.float16: kernels.FLOAT16,
        torch.bfloat16: kernels.BFLOAT16}
SHAPES = [(4096, 4096, 4096), (256, 4096, 4096), (32, 1024, 1024)]
# Targets (fp16 / bf16 without bias): speed-up over torch.relu(a @ b).
TARGETS = {(4096, 4096, 4096): 1.0, (256, 4096, 4096): 1.4, (32, 1024, 1024): 1.4}


def cublaslt_from_wheel() -> None:
    if "DEPLOYKIT_CUBLASLT_LIB" in os.environ:
        return
    try:
        import nvidia
    except ImportError:
        return
    for root in nvidia.__path__:
        found = sorted(glob.glob(os.path.join(root, "*", "lib", "libcublasLt.so.*")))
        if found:
            os.environ["DEPLOYKIT_CUBLASLT_LIB"] = found[0]
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", default=os.environ.get(kernels.ENV_VAR))
    parser.add_argument("--out")
    args = parser.parse_args()
    cublaslt_from_wheel()
    lib = kernels.load(args.lib)
    env = timing.environment()
    env["cublaslt"] = bool(lib.dk_cublaslt_available())
    print(env, flush=True)
    ws = torch.empty(max(lib.dk_matmul_relu_cuda_workspace_bytes(), 16), dtype=torch.uint8,
                     device="cuda")
    cases = [(dt, s, False, False) for dt in (torch.float16, torch.bfloat16) for s in SHAPES]
    cases += [(dt, s, True, False) for dt in (torch.float16, torch.bfloat16) for s in SHAPES]
    cases += [(torch.float32, s, bias, tf32) for tf32 in (True, False) for bias in (False, True)
              for s in SHAPES]
    rows, errors = [], []
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    for dtype, (m, k, n), with_bias, tf32 in cases:
        label = f"{str(dtype)[6:]} {m}x{k}x{n} bias={with_bias} tf32={tf32}"
        try:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            es = torch.tensor([], dtype=dtype).element_size()
            sets = timing.rotation((m * k + k * n + m * n) * es, at_least=2, most=64)
            torch.manual_seed(0)
            a_s = [torch.randn(m, k, device="cuda").to(dtype) for _ in range(sets)]
            b_s = [(torch.randn(k, n, device="cuda") / k ** 0.5).to(dtype) for _ in range(sets)]
            bias = torch.randn(n, device="cuda").to(dtype) if with_bias else None
            ys = [torch.empty(m, n, device="cuda", dtype=dtype) for _ in range(sets)]
            stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731

            def ours(a, b, y):
                status = lib.dk_matmul_relu_cuda(
                    CODE[dtype], a.data_ptr(), b.data_ptr(),
                    None if bias is None else bias.data_ptr(), y.data_ptr(), m, k, n, int(tf32),
                    ws.data_ptr(), ws.numel(), stream())
                if status != kernels.OK:
                    raise RuntimeError(f"dk_matmul_relu_cuda: status {status}")

            def product(a, b):
                return a @ b if bias is None else torch.addmm(bias, a, b)

            def reference(a, b):
                return torch.relu(product(a, b))

            ys[0].fill_(float("nan"))
            ours(a_s[0], b_s[0], ys[0])
            ref64 = torch.relu(a_s[0].double() @ b_s[0].double()
                               + (0 if bias is None else bias.double()))
            err = float((ys[0].double() - ref64).norm() / ref64.norm())
            torch_err = float((reference(a_s[0], b_s[0]).double() - ref64).norm() / ref64.norm())
            path = lib.dk_matmul_relu_cuda_last_path()
            t_ours = timing.graph_time_us(
                [lambda a=a, b=b, y=y: ours(a, b, y) for a, b, y in zip(a_s, b_s, ys)])
            t_ref = timing.graph_time_us([lambda a=a, b=b: reference(a, b)
                                          for a, b in zip(a_s, b_s)])
            t_product = timing.graph_time_us([lambda a=a, b=b: product(a, b)
                                              for a, b in zip(a_s, b_s)])
            flop = 2 * m * k * n
            target = TARGETS.get((m, k, n)) if dtype != torch.float32 and not with_bias else None
            speedup = t_ref / t_ours
            met = "" if target is None else ("yes" if speedup >= target else "NO")
            rows.append([str(dtype)[6:], f"{m}x{k}x{n}", "yes" if with_bias else "no",
                         ("on" if tf32 else "off") if dtype == torch.float32 else "-",
                         f"{t_ours:.1f}", f"{t_ref:.1f}", f"{speedup:.2f}", f"{t_product:.1f}",
                         f"{t_product / t_ours:.2f}",
                         f"{flop / t_ours / 1e6:.0f}", f"{flop / t_ref / 1e6:.0f}",
                         {0: "cuBLASLt", 1: "fallback"}.get(path, str(path)),
                         f"{err:.1e} / {torch_err:.1e}", f">= {target:.1f}x" if target else "-",
                         met])
            print(" | ".join(rows[-1]), flush=True)
            del a_s, b_s, ys
            torch.cuda.empty_cache()
        except Exception as error:
            errors.append(f"{label}: {error!r}")
            traceback.print_exc()
    torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    header = ["dtype", "m x k x n", "bias", "tf32", "ours us", "torch us", "torch/ours",
              "torch product only us", "product only/ours",
              "ours TFLOP/s", "torch TFLOP/s", "path", "rel err ours / torch (vs fp64)",
              "target", "met"]
    text = timing.write_outputs(args.out, "MatMulRelu (CUDA graphs, median)", env, header, rows,
                                {"errors": errors})
    print(text)
    if errors:
        print("ERRORS:", *errors, sep="\n  ")


if __name__ == "__main__":
    main()
