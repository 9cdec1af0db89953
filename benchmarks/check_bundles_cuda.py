"""Run bundles in ONNX Runtime's CUDA EP (deploykit.load, device="cuda") and compare with the
fp32 reference graph run on the CPU: the bundle's ``model.fp32.onnx`` for reduced-precision
bundles (itself validated against PyTorch), else its ``model.onnx``.

With ``--factory``, a reduced-precision bundle is also set beside PyTorch's own: the source
model cast to the bundle's precision on the GPU, against the same reference. That says how
much of the error the precision costs any runtime, not only ours.

Outputs are judged with the tolerances the bundle was validated with at conversion (report.json).

Usage: python3 benchmarks/check_bundles_cuda.py [--factory MODULE:FN] BUNDLE [BUNDLE ...]
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

import deploykit
from deploykit import runtime
from deploykit.tools import bench as benchmark
from deploykit.backends.torch.runner import flatten_outputs
from deploykit.validation.compare import Tolerance, compare_output


def check(bundle: Path, factory: str | None) -> bool:
    manifest = json.loads((bundle / "manifest.json").read_text())
    precision = manifest.get("precision", "fp32")
    reference = _reference_session(bundle, manifest, precision)
    # Measure a bundle whose CPU validation failed too: this script reports, it does not gate.
    runner = deploykit.load(bundle, backend="onnxruntime", device="cuda", allow_failed=True)
    feeds = runtime.random_inputs(manifest["inputs"], 4, seed=11)
    fp32_feeds = {name: array.astype(np.float32) if array.dtype.kind == "f" else array for name, array in feeds.items()}
    expected = dict(zip([o.name for o in reference.get_outputs()], reference.run(None, fp32_feeds)))
    tolerances = _validated_tolerances(bundle)
    candidates = {"bundle, ORT CUDA EP": runner.run(feeds)}
    if factory and precision != "fp32":
        candidates[f"PyTorch {precision}, CUDA"] = _pytorch_outputs(bundle, factory, precision, feeds, list(expected))
    ok = True
    for label, outputs in candidates.items():
        for name, want in expected.items():
            got = np.asarray(outputs[name], dtype=np.float32)
            result = compare_output(name, want, got, tolerances[name])
            ok &= result.passed or label.startswith("PyTorch")  # PyTorch's own error is context, not a gate
            metrics = result.metrics
            print(f"{bundle.name} [{precision}] {label}, {name}: max abs {metrics['max_abs']:.3g} "
                  f"(|ref| max {metrics['ref_max_abs']:.3g}), cosine {metrics['cosine']:.7f}, "
                  f"top-1 {metrics.get('top1_agreement', float('nan')):.3f}: "
                  f"{'pass' if result.passed else 'FAIL ' + '; '.join(result.failures)}")
    print(f"{bundle.name}: {runner.describe()}")
    return ok


def _validated_tolerances(bundle: Path) -> dict[str, Tolerance]:
    report = json.loads((bundle / "report.json").read_text())
    first_run = report["validation"]["candidates"][0]["runs"][0]
    return {o["name"]: Tolerance(**o["tolerance"]) for o in first_run["outputs"]}


def _reference_session(bundle: Path, manifest: dict, precision: str):
    options = ort.SessionOptions()
    library = next(iter(manifest.get("custom_op_libraries", [])), None)
    if library:
        options.register_custom_ops_library(str(bundle / library["file"]))
    reference_file = bundle / (manifest.get("reference_model", "model.fp32.onnx") if precision != "fp32" else "model.onnx")
    return ort.InferenceSession(str(reference_file), options, providers=["CPUExecutionProvider"])


def _pytorch_outputs(bundle: Path, factory: str, precision: str, feeds: dict, names: list[str]) -> dict:
    import torch

    opened = runtime.open_bundle(bundle)
    source = benchmark.load_source(opened, None, factory, False)
    if source.loaded is None:
        raise SystemExit(source.reason)
    module = source.loaded.module.to(device="cuda", dtype=benchmark.torch_dtype(precision))
    with torch.inference_mode():
        outs = flatten_outputs(module(*[t.cuda() for t in benchmark.cast_feeds(feeds, precision).values()]))
    return {name: o.float().cpu().numpy() for name, o in zip(names, outs)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--factory", help="the bundles' source model factory (module:function)")
    args = parser.parse_args()
    results = [check(path, args.factory) for path in args.bundles]
    sys.exit(0 if all(results) else 1)
