"""Run bundles in ONNX Runtime's CUDA EP (deploykit.load, device="cuda") and compare with the
fp32 reference graph run on the CPU: the bundle's ``model.fp32.onnx`` for reduced-precision
bundles (itself validated against PyTorch), else its ``model.onnx``.

Usage: python3 benchmarks/check_bundles_cuda.py BUNDLE [BUNDLE ...]
"""

import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

import deploykit
from deploykit.compare import Tolerance, compare_output


def check(bundle: Path) -> bool:
    manifest = json.loads((bundle / "manifest.json").read_text())
    precision = manifest.get("precision", "fp32")
    reference_file = bundle / ("model.fp32.onnx" if precision != "fp32" else "model.onnx")
    options = ort.SessionOptions()
    library = next(iter(manifest.get("custom_op_libraries", [])), None)
    if library:
        options.register_custom_ops_library(str(bundle / library["file"]))
    reference = ort.InferenceSession(str(reference_file), options, providers=["CPUExecutionProvider"])
    # Measure a bundle whose CPU validation failed too: this script reports, it does not gate.
    runner = deploykit.load(bundle, backend="onnxruntime", device="cuda", allow_failed=True)
    rng = np.random.default_rng(11)
    feeds = {i.name: rng.standard_normal([4 if not isinstance(d, int) else d for d in i.shape], dtype=np.float32)
             for i in reference.get_inputs()}
    expected = dict(zip([o.name for o in reference.get_outputs()], reference.run(None, feeds)))
    actual = runner.run({name: array.astype(_input_dtype(manifest, name)) for name, array in feeds.items()})
    ok = True
    for name, want in expected.items():
        got = np.asarray(actual[name], dtype=np.float32)
        result = compare_output(name, want, got, Tolerance.for_precision(precision))
        ok &= result.passed
        print(f"{bundle.name} [{precision}] {name}: max abs {result.metrics['max_abs']:.3g} "
              f"(|ref| max {result.metrics['ref_max_abs']:.3g}), cosine {result.metrics['cosine']:.6f}, "
              f"top-1 {result.metrics.get('top1_agreement', float('nan')):.3f}: "
              f"{'pass' if result.passed else 'FAIL ' + '; '.join(result.failures)}")
    print(f"{bundle.name}: providers {runner.notes if hasattr(runner, 'notes') else ''}")
    return ok


def _input_dtype(manifest: dict, name: str) -> str:
    return next(i["dtype"] for i in manifest["inputs"] if i["name"] == name)


if __name__ == "__main__":
    results = [check(Path(path)) for path in sys.argv[1:]]
    sys.exit(0 if all(results) else 1)
