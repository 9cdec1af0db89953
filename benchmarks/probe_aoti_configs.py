"""Why does torch.compile(mode="reduce-overhead") run resnet50 fp32 at batch 32 faster than our
AOTInductor package (BENCHMARKS.md, issue 13)? Times, in one process and interleaved rounds, the
source model under reduce-overhead against AOTInductor packages compiled with different inductor
settings, each replayed as a CUDA graph the way deploykit's runner replays it.

    python3 benchmarks/probe_aoti_configs.py --out $OUT [--model resnet50] [--batch 32] [--precision fp32]
        [--variants 'aoti default,aoti freezing']

Writes probe_aoti_configs.md / .json to --out: per variant, compile seconds and the median of
the per-round median ms (deploykit.tuning.timing's interleaved rounds, as bench times). GPU only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torchvision

from deploykit.backends.aoti.runner import CudaGraph
from deploykit.tuning.timing import Budget, bench_stream, interleave, round_stats

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--precision", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--variants", type=lambda text: text.split(","), default=list(VARIANTS),
                        help=f"comma-separated, of: {', '.join(VARIANTS)} (default: all)")
    args = parser.parse_args()
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
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
        for name in args.variants:
            configs, channels_last = VARIANTS[name]
            start = time.perf_counter()
            try:
                steps[name] = aoti_step(model, example, configs, channels_last, args.out, name.replace(" ", "_"))
            except Exception as error:  # noqa: BLE001 - one variant failing must not end the probe
                print(f"{name}: {error!r:.300}", flush=True)
                continue
            compile_s[name] = time.perf_counter() - start
            print(f"{name}: compiled in {compile_s[name]:.0f} s", flush=True)
        budget = Budget(device="cuda", iterations=args.rounds * args.calls, rounds=args.rounds, max_seconds=30)
        timed = dict(zip(steps, interleave(list(steps.values()), budget)))
    failed = {name: repr(result.error) for name, result in timed.items() if result.error is not None}
    ms = {name: round_stats(result.rounds)["p50_ms"] for name, result in timed.items() if result.error is None}
    rows = [f"| {name} | {compile_s[name]:.0f} | {ms[name]:.3f} | {ms['reduce-overhead'] / ms[name]:.2f} |"
            if name in ms else f"| {name} | {compile_s[name]:.0f} | failed: {failed[name][:80]} | – |" for name in steps]
    table = "\n".join([f"{args.model} {args.precision} batch {args.batch}, {torch.cuda.get_device_name()}, torch {torch.__version__}",
                       "", "| variant | compile s | p50 ms | reduce-overhead / variant |", "| --- | --- | --- | --- |", *rows])
    (args.out / "probe_aoti_configs.md").write_text(table + "\n")
    (args.out / "probe_aoti_configs.json").write_text(json.dumps({"ms": ms, "failed": failed, "compile_s": compile_s, "args": vars(args)},
                                                                 default=str, indent=1))
    for package in args.out.glob("*.pt2"):
        package.unlink()
    print(table)


if __name__ == "__main__":
    main()
