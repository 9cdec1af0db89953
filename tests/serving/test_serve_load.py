"""benchmarks/serve_load.py and summarize_issue16.py on the CPU, small: the Python that
run_issue16_device.sh runs on two GPUs, its servers started by deploykit.serving.launch."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

pytest.importorskip("fastapi")

import converted_bundles  # noqa: E402
from deploykit_cli import BENCHMARKS, run_benchmark, run_deploykit  # noqa: E402


def test_serve_load_over_client_counts_and_the_summary(tmp_path):
    bundle = converted_bundles.converted("tabular")
    load = run_benchmark("serve_load.py", bundle, "--device", "cpu", "--clients", "2,3", "--requests", "4", "--batching", "on",
                  "--out", tmp_path / "serve-1gpu")
    assert load.returncode == 0, load.stderr
    results = json.loads((tmp_path / "serve-1gpu" / "serve_load.json").read_text())["results"]
    assert [(r["mode"], r["clients"], r["requests"], r["errors"], r["wrong"]) for r in results] == [
        ("batching on", 2, 8, 0, 0), ("batching on", 3, 12, 0, 0)]
    assert "Application shutdown complete" in (tmp_path / "serve-1gpu" / "serve-on.log").read_text()  # stderr, logged
    shutil.copytree(tmp_path / "serve-1gpu", tmp_path / "serve-2gpu")  # as if two GPUs served as fast
    bench = run_deploykit("bench", bundle, "--device", "cpu", "--batch", "1,4", "--only", "deploykit-load",
                          "--warmup", "1", "--iterations", "5", "-o", tmp_path / "bench-alone")
    assert bench.returncode == 0, bench.stderr
    summary = run_benchmark("summarize_issue16.py", tmp_path)
    assert summary.returncode == 0, summary.stderr
    rows = [line.split(" | ")[:5] for line in summary.stdout.splitlines() if line.startswith("| batching on |")]
    assert [row[1:3] for row in rows] == [["2", "1"], ["2", "2"], ["3", "1"], ["3", "2"]]
    assert [row[4] for row in rows] == ["1.00"] * 4  # requests/s against the one-GPU run at that many clients
    assert [line.split(" | ")[1] for line in summary.stdout.splitlines() if line.startswith("| GPU 0 alone |")] == [
        "1", "4"]


def test_an_answer_is_wrong_only_outside_the_bundles_tolerances():
    """A row run in a padded batch may round differently from the same row alone (fp16 on a GPU):
    that is not exact but not wrong; an error beyond the bundle's tolerance is wrong."""
    import numpy as np

    from deploykit.validation.compare import Tolerance

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import serve_load
    finally:
        sys.path.remove(str(BENCHMARKS))
    expected = np.linspace(-1, 1, 10, dtype=np.float16).reshape(1, 10)
    case = serve_load.Case({}, {"y": expected}, {"y": Tolerance.for_precision("fp16")})
    rounded = {"y": expected + np.float16(1e-3)}
    assert not serve_load.is_exact(rounded, case) and serve_load.within_tolerance(rounded, case)
    assert not serve_load.within_tolerance({"y": expected + np.float16(0.5)}, case)
    assert serve_load.is_exact({"y": expected.copy()}, case)
