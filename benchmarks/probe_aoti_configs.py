"""Why does torch.compile(mode="reduce-overhead") run resnet50 fp32 at batch 32 faster than our
AOTInductor package (BENCHMARKS.md, issue 13)? Times, in one process and interleaved rounds, the
source model under reduce-overhead against AOTInductor packages compiled with different inductor
settings, each replayed as a CUDA graph the way deploykit's runner replays it.

    python3 benchmarks/probe_aoti_configs.py --out $OUT [--model resnet50] [--batch 32] [--precision fp32]

Writes probe_aoti_configs.md / .json to --out: per variant, compile seconds and the median of
the per-round median ms. GPU only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torchvision

from deploykit.backends.aoti.runner import CudaGraph
from deploykit.tuning.timing import bench_stream, call_timer

#: variant -> (inductor configs, channels-last model and input)
VARIANTS = {
    "aoti default": ({}, False),
    "aoti freezing": ({"freezing": True}, False),
    "aoti channels_last": ({}, True),
    "aoti freezing + channels_last": ({"freezing": True}, True),
}


def aoti_step(model, example, configs: dict, channels_last: bool, folder: Path, name: str):
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        example = example.contiguous(memory_format=torch.channels_last)
    program = torch.export.export(model, (example,), strict=False)
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(folder / f"{name}.pt2"),
                                                    inductor_configs=dict(configs))
    package = torch._inductor.aoti_load_package(path, run_single_threaded=True, device_index=0)  # as load_package
    graph = CudaGraph(package, [example])
    return lambda: graph([example])


def reduce_overhead_step(model, example):
    compiled = torch.compile(model, mode="reduce-overhead")
    return lambda: compiled(example)


def interleaved(steps: dict, rounds: int, calls: int) -> dict[str, float]:
    """Median over rounds of each step's per-round median ms; the order rotates each round."""
    timer, names, medians = call_timer("cuda"), list(steps), {name: [] for name in steps}
    for step in steps.values():
        for _ in range(10):
            step()
    for index in range(rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            medians[name].append(statistics.median(timer(steps[name]) * 1e3 for _ in range(calls)))
    return {name: statistics.median(values) for name, values in medians.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--precision", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = torch.float32 if args.precision == "fp32" else torch.float16
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)().eval().to("cuda", dtype)
    example = torch.randn(args.batch, 3, 224, 224, device="cuda", dtype=dtype)
    steps, compile_s = {}, {}
    with torch.inference_mode(), bench_stream("cuda", tf32=False):
        start = time.perf_counter()
        steps["reduce-overhead"] = reduce_overhead_step(model, example)
        steps["reduce-overhead"]()
        compile_s["reduce-overhead"] = time.perf_counter() - start
        for name, (configs, channels_last) in VARIANTS.items():
            start = time.perf_counter()
            steps[name] = aoti_step(model, example, configs, channels_last, args.out, name.replace(" ", "_"))
            compile_s[name] = time.perf_counter() - start
            print(f"{name}: compiled in {compile_s[name]:.0f} s", flush=True)
        ms = interleaved(steps, args.rounds, args.calls)
    rows = [f"| {name} | {compile_s[name]:.0f} | {ms[name]:.3f} | {ms['reduce-overhead'] / ms[name]:.2f} |" for name in steps]
    table = "\n".join([f"{args.model} {args.precision} batch {args.batch}, {torch.cuda.get_device_name()}, torch {torch.__version__}",
                       "", "| variant | compile s | p50 ms | reduce-overhead / variant |", "| --- | --- | --- | --- |", *rows])
    (args.out / "probe_aoti_configs.md").write_text(table + "\n")
    (args.out / "probe_aoti_configs.json").write_text(json.dumps({"ms": ms, "compile_s": compile_s, "args": vars(args)},
                                                                 default=str, indent=1))
    for package in args.out.glob("*.pt2"):
        package.unlink()
    print(table)


if __name__ == "__main__":
    main()
