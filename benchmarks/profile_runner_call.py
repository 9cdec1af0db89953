"""Where the ONNX Runtime runner's time per call goes beyond ONNX Runtime's floor (issue 13, item 1).

Times, in one process and interleaved rounds (deploykit.tuning.timing, as bench times), the
runner that ``deploykit.load(BUNDLE, backend="onnxruntime", device="cuda")`` returns (CUDA graphs
on) against bench's floor (one IOBinding bound once, a CUDA graph, no copies), at one batch size,
inputs already on the GPU. Then runs the runner's calls under cProfile, so the Python functions
that cost the difference are named.

    python3 benchmarks/profile_runner_call.py BUNDLE [--batch 1] [--calls 500] --out DIR

Writes DIR/profile_runner_call.md: the two p50s and their difference, the host's time per call of
each (a call that returns before its GPU work is done costs the host less than the GPU), then
pstats' top functions by own time and by cumulative time. GPU only.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

import deploykit
from deploykit import runtime
from deploykit.tools.bench import cuda_graph_step
from deploykit.tuning.timing import Budget, bench_stream, interleave, round_stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bundle = runtime.open_bundle(args.bundle)
    feeds = runtime.random_inputs(bundle.inputs, args.batch, 0)
    with bench_stream("cuda", tf32=False):
        runner = deploykit.load(args.bundle, backend="onnxruntime", device="cuda")
        on_gpu = {name: torch.from_numpy(array).cuda() for name, array in feeds.items()}
        steps = [lambda: runner(**on_gpu), cuda_graph_step(bundle, False, False, feeds)]
        budget = Budget(device="cuda", iterations=args.calls, rounds=5, max_seconds=20)
        runner_ms, floor_ms = (round_stats(timed.rounds)["p50_ms"] for timed in interleave(steps, budget))
        host_ms = [host_ms_per_call(step, args.calls) for step in steps]
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            runner(**on_gpu)
            torch.cuda.current_stream().synchronize()
        profile.disable()
    report = [f"{bundle.path.name} batch {args.batch}, {torch.cuda.get_device_name()}: runner {runner_ms:.3f} ms, "
              f"floor {floor_ms:.3f} ms, difference {(runner_ms - floor_ms) * 1e3:.0f} us per call",
              f"host time per call, until the call returns (≈ the GPU time where a call waits for its work): "
              f"runner {host_ms[0]:.3f} ms, floor {host_ms[1]:.3f} ms",
              f"runner: {runner.describe()}", ""]
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(25)
        report += [f"## by {order} ({args.calls} calls)", "```", text.getvalue().strip(), "```", ""]
    (args.out / "profile_runner_call.md").write_text("\n".join(report))
    print("\n".join(report[:3]))


def host_ms_per_call(step, calls: int) -> float:
    """Milliseconds the host spends in one call, calls back to back (the GPU drained before and after)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


if __name__ == "__main__":
    main()
