"""``deploykit validate BUNDLE MODEL``: the bundle, run as deployed here, against its PyTorch model.

Bundles of model_zoo's tabular net (two outputs, one deploykit::MatMulRelu) are converted once
through the CLI; every check runs the CLI as users do and reads its exit code and --json.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import model_zoo
from deploykit import runtime
from deploykit.bundle.format import sha256_of
from deploykit.testing import randomize_batch_norm
from deploykit_cli import run_deploykit


def deploykit(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return run_deploykit(*args, cwd=cwd, columns=160)


def save_tabular(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    torch.save(randomize_batch_norm(model_zoo.tabular(), seed=seed + 1).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """tabular.pt and its fp32 bundle (batch 1:2:4) and fp16 bundle (fp16 inputs and outputs)."""
    work = tmp_path_factory.mktemp("validate")
    save_tabular(work / "tabular.pt", seed=0)
    common = ["tabular.pt", "--factory", "model_zoo:tabular", "--input", "features:1x13", "--batch", "1:2:4"]
    for out, extra in (("fp32", []), ("fp16", ["--precision", "fp16", "--io-precision", "fp16"])):
        result = deploykit(work, "convert", *common, *extra, "-o", out)
        assert result.returncode == 0, result.stderr
    return work


def validate_json(work: Path, *args: str) -> tuple[int, dict]:
    result = deploykit(work, "validate", *args, "--json")
    return result.returncode, json.loads(result.stdout) if result.stdout else {"stderr": result.stderr}


def test_the_bundle_passes_at_each_batch_size_of_its_range_with_our_op_library(work):
    hashes = {p.name: sha256_of(p) for p in (work / "fp32").iterdir()}
    code, summary = validate_json(work, "fp32", "tabular.pt", "--factory", "model_zoo:tabular")
    assert code == 0 and summary["passed"] and summary["failures"] == []
    assert summary["op_library"] == "libdeploykit_ort.so" and summary["precision"] == "fp32"
    runs = summary["validation"]["runs"]
    assert [run["batch"] for run in runs] == [1, 2, 4]
    assert [o["name"] for o in runs[0]["outputs"]] == ["output_0", "output_1"]
    assert all(o["metrics"]["max_abs"] < 1e-4 for run in runs for o in run["outputs"])
    assert {p.name: sha256_of(p) for p in (work / "fp32").iterdir()} == hashes  # only read


def test_user_data_reaches_an_fp16_bundle_as_fp16_and_the_fp16_tolerance_applies(work):
    np.savez(work / "data.npz", features=np.random.default_rng(3).standard_normal((5, 13)).astype(np.float32))
    code, summary = validate_json(work, "fp16", "tabular.pt", "--factory", "model_zoo:tabular",
                                  "--inputs", "data.npz")
    assert code == 0, summary
    assert summary["precision"] == "fp16" and summary["inputs"] == "data.npz"
    [run] = summary["validation"]["runs"]
    assert run["batch"] == 5
    assert all(o["tolerance"]["atol"] == 1e-2 and o["metrics"]["max_abs"] > 0 for o in run["outputs"])


def test_other_weights_fail_with_exit_1_naming_the_output(work):
    save_tabular(work / "retrained.pt", seed=7)
    result = deploykit(work, "validate", "fp32", "retrained.pt", "--factory", "model_zoo:tabular", "--batch", "3")
    assert result.returncode == 1, result.stderr
    assert "output output_0 (batch 3)" in result.stderr and "FAIL" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_tolerance_of_the_users_decides(work):
    code, summary = validate_json(work, "fp32", "tabular.pt", "--factory", "model_zoo:tabular",
                                  "--tolerance", "output_1:atol=0,rtol=0,min_cosine=1")
    assert code == 1 and not summary["passed"]
    assert all("output output_1" in line for line in summary["failures"])


@pytest.mark.parametrize("args, message", [
    (["--factory", "model_zoo:one_output"], "returns 1 output(s), the bundle 2 (output_0, output_1)"),
    (["--factory", "model_zoo:tabular", "--inputs", "data.npz", "--batch", "2"], "--batch applies to random inputs"),
])
def test_bad_requests_get_one_line_and_exit_2(work, args, message):
    np.savez(work / "data.npz", features=np.zeros((2, 13), np.float32))
    if "one_output" in args[1]:
        torch.save(model_zoo.one_output().state_dict(), work / "tabular.pt.one")
        model = "tabular.pt.one"
    else:
        model = "tabular.pt"
    result = deploykit(work, "validate", "fp32", model, *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_a_bundle_that_failed_conversion_needs_allow_failed(work):
    result = deploykit(work, "convert", "tabular.pt", "--factory", "model_zoo:tabular", "--input", "features:1x13",
                       "--tolerance", "atol=0,rtol=0,min_cosine=1", "-o", "failed")
    assert result.returncode == 1, result.stderr
    refused = deploykit(work, "validate", "failed", "tabular.pt", "--factory", "model_zoo:tabular")
    assert refused.returncode == 1 and "--allow-failed" in refused.stderr
    failed = ["validate", "failed", "tabular.pt", "--factory", "model_zoo:tabular", "--allow-failed"]
    again = deploykit(work, *failed)
    assert again.returncode == 1, again.stderr  # judged by the conversion's tolerances, which the manifest records
    assert runtime.open_bundle(work / "failed").tolerances == ["atol=0,rtol=0,min_cosine=1"]
    assert "tolerances: --tolerance atol=0,rtol=0,min_cosine=1" in deploykit(work, "inspect", "failed").stderr
    loosened = deploykit(work, *failed, "--tolerance", "atol=1e-4,rtol=1e-3,min_cosine=0.99999")
    assert loosened.returncode == 0, loosened.stderr  # a --tolerance of validate's applies after the bundle's
