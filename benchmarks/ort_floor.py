"""How close ``deploykit.load(bundle, device="cuda")`` comes to ONNX Runtime's own floor.

The floor is a hand-written IOBinding, bound once per batch size to inputs already on the GPU and
to preallocated outputs, replayed as a CUDA graph (run option ``gpu_graph_id``) without a
synchronisation at the end of each run: nothing a runner can do costs less. Beside it, the
runner as users call it (``runner(x=tensor)`` -> fresh output tensors), with its defaults, with
CUDA graphs off and with ``prefer_nhwc``. Each (contender, batch) is timed by CUDA events around a
loop of calls on torch's current stream; the median of ``--rounds`` rounds is reported, after a
warm-up that includes capture.

    python benchmarks/ort_floor.py BUNDLE [BUNDLE...] --batch 1,32 -o results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

import deploykit
from deploykit.runtime import random_inputs


def floor_step(bundle: Path, feeds: dict, graph: bool):
    """The hand-written IOBinding: bound once, replayed, no synchronisation per run."""
    runner = deploykit.load(bundle, device="cuda", cuda_graph=graph, stream=torch.cuda.current_stream().cuda_stream)
    inputs = {name: torch.from_numpy(array).cuda() for name, array in feeds.items()}
    outputs = [torch.empty(shape, dtype=getattr(torch, spec["dtype"]), device="cuda")
               for spec, shape in zip(runner.outputs, runner.output_shapes(deploykit.runtime.collect_feeds(
                   inputs, {}, runner.inputs)))]
    binding = runner.session.io_binding()
    for name, tensor in inputs.items():
        binding.bind_input(name, "cuda", 0, np.dtype(str(tensor.dtype).removeprefix("torch.")), list(tensor.shape),
                           tensor.data_ptr())
    for spec, tensor in zip(runner.outputs, outputs):
        binding.bind_output(spec["name"], "cuda", 0, np.dtype(spec["dtype"]), list(tensor.shape), tensor.data_ptr())
    options = ort.RunOptions()
    options.add_run_config_entry("disable_synchronize_execution_providers", "1")
    if graph:
        options.add_run_config_entry("gpu_graph_id", "1")
    return lambda: (runner.session.run_with_iobinding(binding, options), outputs)


def runner_step(bundle: Path, feeds: dict, **options):
    runner = deploykit.load(bundle, device="cuda", **options)
    inputs = {name: torch.from_numpy(array).cuda() for name, array in feeds.items()}
    return lambda: runner(inputs)


CONTENDERS = {
    "floor: hand-written IOBinding + CUDA graph": lambda b, f: floor_step(b, f, True),
    "floor: hand-written IOBinding, no graph": lambda b, f: floor_step(b, f, False),
    "deploykit.load default": lambda b, f: runner_step(b, f),
    "deploykit.load cuda_graph=False": lambda b, f: runner_step(b, f, cuda_graph=False),
    "deploykit.load prefer_nhwc=True": lambda b, f: runner_step(b, f, prefer_nhwc=True),
}


def time_loop(step, calls: int, rounds: int, warmup: int = 20) -> float:
    """Median over rounds of (CUDA-event time of ``calls`` back-to-back calls) / calls, in ms."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            step()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    return statistics.median(per_call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for bundle in args.bundles:
        specs = deploykit.open_bundle(bundle).inputs
        for batch in [int(b) for b in args.batch.split(",")]:
            feeds = random_inputs(specs, batch, seed=0)
            for label, make in CONTENDERS.items():
                try:
                    ms = time_loop(make(bundle, feeds), args.calls, args.rounds)
                    row = {"bundle": bundle.name, "batch": batch, "contender": label, "ms": ms}
                except Exception as error:  # noqa: BLE001 - one contender failing is a row, not the end
                    row = {"bundle": bundle.name, "batch": batch, "contender": label, "error": str(error)[:300]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                args.output.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
