"""Where the ONNX Runtime runner's time per call goes beyond ONNX Runtime's floor (issue 13, item 1).

Times, in one process and interleaved rounds (deploykit.tuning.timing, as bench times), the
runner that ``deploykit.load(BUNDLE, backend="onnxruntime", device="cuda")`` returns (CUDA graphs
on) against bench's floor (one IOBinding bound once, a CUDA graph, no copies), at one batch size,
inputs already on the GPU, and between them the runner's call taken apart (``PARTS``: without
the input checks, then without locks and stream query, then the bare replay), so the cost of each
part shows without a profiler's inflation. Then runs the runner's calls under cProfile, so the
Python functions that cost the difference are named.

    python3 benchmarks/profile_runner_call.py BUNDLE [--batch 1] [--calls 500] --out DIR

Writes DIR/profile_runner_call.md: the runner's and the floor's p50 and their difference, a table
of every step's p50 (one synchronous call: latency) and its time per call back to back (steady
throughput, by CUDA events and by the host's clock), then pstats' top functions by own time and by
cumulative time. GPU only.
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
        steps = {"runner": lambda: runner(**on_gpu), **runner_parts(runner, on_gpu),
                 "hand-written": cuda_graph_step(bundle, False, False, feeds, copy_from=list(on_gpu.values())),
                 "floor": cuda_graph_step(bundle, False, False, feeds)}
        budget = Budget(device="cuda", iterations=args.calls, rounds=5, max_seconds=30)
        timed = interleave(list(steps.values()), budget)
        p50 = {label: round_stats(result.rounds)["p50_ms"] for label, result in zip(steps, timed)}
        back_to_back = {label: back_to_back_ms(step, args.calls) for label, step in steps.items()}
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            runner(**on_gpu)
            torch.cuda.current_stream().synchronize()
        profile.disable()
    report = [f"{bundle.path.name} batch {args.batch}, {torch.cuda.get_device_name()}: runner {p50['runner']:.3f} ms, "
              f"floor {p50['floor']:.3f} ms, difference {(p50['runner'] - p50['floor']) * 1e3:.0f} us per call; "
              f"hand-written {p50['hand-written']:.3f} ms, runner / hand-written {p50['runner'] / p50['hand-written']:.3f}",
              f"runner: {runner.describe()}", "",
              "| step | p50 ms, one synchronous call | ms per call back to back: GPU | host |",
              "| --- | ---: | ---: | ---: |",
              *(f"| {label}: {PARTS.get(label, '')} | {p50[label]:.3f} | {back_to_back[label][0]:.3f} | "
                f"{back_to_back[label][1]:.3f} |" for label in steps), ""]
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(25)
        report += [f"## by {order} ({args.calls} calls)", "```", text.getvalue().strip(), "```", ""]
    (args.out / "profile_runner_call.md").write_text("\n".join(report))
    print("\n".join(report[:report.index("", 3)]))


#: What each timed step runs; each adds one part of the runner's call to the one after it.
PARTS = {"runner": "deploykit.load(BUNDLE)(**inputs)",
         "planned": "the runner's per-shape plan on inputs checked once (no input checks, no output kinds)",
         "copies": "copies into the plan's graph, its replay, copies out (no locks, no stream query)",
         "replay": "the plan's graph replayed, nothing else",
         "hand-written": "the inputs copied into an IOBinding bound once, then ONNX Runtime's own graph (issue 13's "
                         "hand-written reused IOBinding; outputs read in place)",
         "floor": "ONNX Runtime's own graph, bound once (its replay waits for the GPU)"}


def runner_parts(runner, on_gpu: dict) -> dict:
    """The runner's call taken apart, on its own captured plan, so each part's cost shows."""
    for _ in range(4):  # the shape's warm-up runs and its capture
        runner(**on_gpu)
    given = runner.checked_feeds(None, on_gpu)
    runs = runner.cuda_runs
    (plan,) = runs.plans.values()
    if plan is None or plan.graph is None:
        raise SystemExit(f"the runner captured no graph for this shape: {runner.notes}")
    tensors = list(on_gpu.values())

    def copies():
        runs.copy_inputs(plan, tensors)
        plan.graph.replay()
        return runs.copy_outputs(plan)

    return {"planned": lambda: runs.run(given, runner.output_shapes), "copies": copies,
            "replay": plan.graph.replay}


def back_to_back_ms(step, calls: int) -> tuple[float, float]:
    """Milliseconds per call over ``calls`` calls queued back to back with no synchronise between
    them (a server's steady state): by CUDA events around them all, and by the host's clock until
    the last call returned. A call that returns before its GPU work is done costs the host less."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    began = time.perf_counter()
    start.record()
    for _ in range(calls):
        step()
    host = time.perf_counter() - began
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls, host / calls * 1e3


if __name__ == "__main__":
    main()
