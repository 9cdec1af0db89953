"""deploykit BatchNorm (deploykit.experimental.training_batch_norm) against PyTorch on the current GPU.

    python benchmarks/bench_batch_norm.py [--lib libdeploykit_kernels.so] [--out bn.md]

Times, per shape and dtype, the eval forward (running statistics; the FusedBatchNorm kernel),
the training forward (batch statistics + running-statistics update) and the backward
(dx, dweight, dbias), each next to PyTorch's equivalent in the same run:
F.batch_norm(training=False / True) and aten.native_batch_norm_backward; also a whole autograd
step (forward + torch.autograd.grad) of each. Times are medians over CUDA-graph replays timed
with CUDA events (see timing.py); input sets rotate when one set is smaller than 3x L2.
The memory floor is the bytes each op must move (eval: read x, write y; train: read x twice,
write y; backward: read dy and x twice, write dx) over the device-to-device copy bandwidth
measured in the same run (after 0.5 s of copies, so the clocks have settled); targets are judged
against the issue's reference floor at 4.26 TB/s. "eval fwd" is the deployed FusedBatchNorm
kernel on folded scale / bias; "eval fwd unfolded" our (x - mean) * scale + bias kernel.
Outputs are compared with PyTorch's first. "copy-equiv" is a plain elementwise copy
(torch.mul(x, 1.0, out=y): one read, one write) of the same size and dtype timed the same way,
scaled to the op's passes: what a simple streaming kernel reaches at this size in practice.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import timing  # noqa: E402
from deploykit.experimental import training_batch_norm as bn  # noqa: E402

F = torch.nn.functional
SHAPES = [(64, 64, 112, 112), (8, 32, 512, 512), (256, 2048, 7, 7)]
# Not a target of issue 4, but a ResNet-50 training shape with 14x14 rows (784 bytes in fp32).
EXTRA_SHAPES = [(256, 1024, 14, 14)]
DTYPES = [torch.float32, torch.float16]
PASSES = {"eval fwd": 2, "eval fwd unfolded": 2, "train fwd": 3, "backward": 5,
          "fwd+bwd step": 8}
TARGETS = {"eval fwd": 1.10, "eval fwd unfolded": 1.10, "train fwd": 1.25, "backward": 1.25}
REFERENCE_BW = 4.26e12  # the copy bandwidth on the H200
EPS, MOMENTUM = 1e-5, 0.1


def rel(a, ref) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-300))


def measure(label, fn, errors):
    try:
        return fn()
    except Exception as error:  # keep going: one failing case must not hide the others
        errors.append(f"{label}: {error!r}")
        traceback.print_exc()
        return float("nan")


def bench_case(shape, dtype, bw, errors, targets=True):
    numel, es, c = math.prod(shape), torch.tensor([], dtype=dtype).element_size(), shape[1]
    sets = timing.rotation(numel * es, at_least=2)
    torch.manual_seed(0)
    xs = [(torch.randn(shape, device="cuda") * 2 + 0.5).to(dtype) for _ in range(sets)]
    dys = [torch.randn(shape, device="cuda").to(dtype) for _ in range(sets)]
    w = torch.rand(c, device="cuda") + 0.5
    b = torch.randn(c, device="cuda")
    rm, rv = torch.randn(c, device="cuda") * 0.1, torch.rand(c, device="cuda") + 0.5
    label = f"{tuple(shape)} {str(dtype)[6:]}"

    # Correctness against PyTorch on these inputs.
    checks = {}
    rm_o, rv_o, rm_t, rv_t = rm.clone(), rv.clone(), rm.clone(), rv.clone()
    y_o, m_o, i_o = bn.train_forward(xs[0], w, b, rm_o, rv_o, MOMENTUM, EPS)
    y_t, m_t, i_t = torch.ops.aten.native_batch_norm(xs[0], w, b, rm_t, rv_t, True, MOMENTUM, EPS)
    checks["train y"] = rel(y_o, y_t)
    checks["running_var"] = rel(rv_o, rv_t)
    dx_o, dw_o, db_o = bn.backward(dys[0], xs[0], w, m_o, i_o, True)
    dx_t, dw_t, db_t = torch.ops.aten.native_batch_norm_backward(
        dys[0], xs[0], w, rm_t, rv_t, m_t, i_t, True, EPS, [True, True, True])
    checks["dx"], checks["dweight"] = rel(dx_o, dx_t), rel(dw_o, dw_t)
    checks["dbias"] = rel(db_o, db_t)
    checks["eval y"] = rel(bn.eval_forward(xs[0], w, b, rm, rv, EPS),
                           F.batch_norm(xs[0], rm, rv, w, b, False, MOMENTUM, EPS))
    del y_o, y_t, dx_o, dx_t
    print(label, "rel. difference to PyTorch:", {k: f"{v:.1e}" for k, v in checks.items()},
          flush=True)

    stats = [bn.train_forward(x, w, b, None, None, MOMENTUM, EPS)[1:] for x in xs]
    tstats = [torch.ops.aten.native_batch_norm(x, w, b, None, None, True, MOMENTUM, EPS)[1:]
              for x in xs]
    rows = []
    wq, bq = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    xq = [x.clone().requires_grad_(True) for x in xs]
    ops = {
        "eval fwd": (
            [lambda x=x: bn.eval_forward(x, w, b, rm, rv, EPS) for x in xs],
            [lambda x=x: F.batch_norm(x, rm, rv, w, b, False, MOMENTUM, EPS) for x in xs]),
        "eval fwd unfolded": (
            [lambda x=x: bn.eval_forward(x, w, b, rm, rv, EPS, fold=False) for x in xs],
            [lambda x=x: F.batch_norm(x, rm, rv, w, b, False, MOMENTUM, EPS) for x in xs]),
        "train fwd": (
            [lambda x=x: bn.train_forward(x, w, b, rm_o, rv_o, MOMENTUM, EPS) for x in xs],
            [lambda x=x: F.batch_norm(x, rm_t, rv_t, w, b, True, MOMENTUM, EPS) for x in xs]),
        "backward": (
            [lambda x=x, dy=dy, s=s: bn.backward(dy, x, w, s[0], s[1], True)
             for x, dy, s in zip(xs, dys, stats)],
            [lambda x=x, dy=dy, s=s: torch.ops.aten.native_batch_norm_backward(
                dy, x, w, rm_t, rv_t, s[0], s[1], True, EPS, [True, True, True])
             for x, dy, s in zip(xs, dys, tstats)]),
        "fwd+bwd step": (
            [lambda x=x, dy=dy: torch.autograd.grad(
                bn.batch_norm(x, rm_o, rv_o, wq, bq, True, MOMENTUM, EPS), (x, wq, bq), dy)
             for x, dy in zip(xq, dys)],
            [lambda x=x, dy=dy: torch.autograd.grad(
                F.batch_norm(x, rm_t, rv_t, wq, bq, True, MOMENTUM, EPS), (x, wq, bq), dy)
             for x, dy in zip(xq, dys)]),
    }
    # Practical reference: a plain elementwise copy (read x, write y) of this size and dtype in
    # the same run, scaled to each op's passes ("copy-equiv").
    ys = [torch.empty_like(x) for x in xs]
    copy_us = measure(f"{label} copy", lambda: timing.graph_time_us(
        [lambda x=x, y=y: torch.mul(x, 1.0, out=y) for x, y in zip(xs, ys)]), errors)
    del ys
    for op, (ours_calls, torch_calls) in ops.items():
        ours = measure(f"{label} {op} ours", lambda: timing.graph_time_us(ours_calls), errors)
        ref = measure(f"{label} {op} torch", lambda: timing.graph_time_us(torch_calls), errors)
        nbytes = PASSES[op] * numel * es
        floor = nbytes / bw * 1e6
        target = TARGETS.get(op) if targets else None
        ref_floor = nbytes / REFERENCE_BW * 1e6
        met = "" if target is None or ours != ours else (
            "yes" if ours <= target * ref_floor else "NO")
        copy_equiv = copy_us * PASSES[op] / 2
        rows.append([op, str(tuple(shape)), str(dtype)[6:], f"{ours:.1f}", f"{ref:.1f}",
                     f"{ref / ours:.2f}", f"{floor:.1f}", f"{ref_floor:.1f}",
                     f"{ours / floor:.2f}", f"{ours / ref_floor:.2f}",
                     f"{100 * floor / ours:.0f}%", f"{copy_equiv:.1f}",
                     f"{ours / copy_equiv:.2f}",
                     f"<= {target:.2f}" if target else "-", met])
        print(" | ".join(rows[-1]), flush=True)
    del xs, dys, stats, tstats, xq
    torch.cuda.empty_cache()
    return rows, {label: checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", help="libdeploykit_kernels.so (default: $DEPLOYKIT_KERNELS_LIB "
                                      "or deploykit's native build)")
    parser.add_argument("--out", help="write the table here (markdown, plus a .json twin)")
    parser.add_argument("--shapes", default="all", help="'all' (the target shapes, then the extra "
                                                        "ones) or e.g. 64x64x112x112,8x32x512x512")
    args = parser.parse_args()
    if args.lib:
        bn.use_library(args.lib)
    shapes = SHAPES + EXTRA_SHAPES if args.shapes == "all" else [
        tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    env = timing.environment()
    bw = timing.copy_bandwidth()
    env["copy_TBps"] = f"{bw / 1e12:.3f}"
    print(env, flush=True)
    rows, checks, errors = [], {}, []
    for dtype in DTYPES:
        for shape in shapes:
            r, c = bench_case(shape, dtype, bw, errors, targets=shape in SHAPES)
            rows += r
            checks.update(c)
    bw_end = timing.copy_bandwidth()
    env["copy_TBps_end"] = f"{bw_end / 1e12:.3f}"
    header = ["op", "shape", "dtype", "ours us", "torch us", "torch/ours", "floor us",
              "floor us @4.26TB/s", "ours/floor", "ours/floor@4.26", "% of floor",
              "copy-equiv us", "ours/copy-equiv",
              "target (x floor@4.26)", "met"]
    text = timing.write_outputs(args.out, "BatchNorm (CUDA graphs, median)", env, header, rows,
                                {"checks": checks, "errors": errors})
    print(text)
    if errors:
        print("ERRORS:", *errors, sep="\n  ")


if __name__ == "__main__":
    main()
