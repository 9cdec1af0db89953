"""Convert real models through the CLI with dynamic batch and check the bundle passes fp32.

Each model comes from a factory in ``model_zoo`` and a state_dict with randomised
BatchNorm statistics, saved the way DDP saves it (``module.`` prefixes).
"""

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import model_zoo
from bundle_reports import custom_op_counts
from deploykit.testing import randomize_batch_norm
from deploykit_cli import convert
from model_zoo import save_ddp_state_dict

# model factory -> (input spec without batch, deploykit ops the graph must end up with)
MODELS = {
    "resnet18": ("x:1x3x67x53", {}),
    "mobilenet_v3_small": ("x:1x3x67x53", {}),
    # 58 dense layers' norm1 (after a concat), 3 transitions and norm5 follow no weight
    "densenet121": ("x:1x3x64x57", {"deploykit::FusedBatchNorm": 62}),
    # the exporters fold the BatchNorms after convs; those before a ReLU (pre-activation) or
    # alone on a branch (RepVGG's identity) remain and become deploykit ops
    "resnetv2_18": ("x:1x3x67x53", {"deploykit::FusedBatchNorm": 9}),
    "repvgg_a0": ("x:1x3x67x53", {"deploykit::FusedBatchNorm": 17}),
    "efficientnet_b0": ("x:1x3x67x53", {}),
    "decoder": ("x:1x8x7x5", {}),
    "tabular": ("features:1x13", {"deploykit::MatMulRelu": 1}),
    "transformer_mlp": ("tokens:1x9x40", {"deploykit::MatMulRelu": 4}),
}
# Rules that must fire where the exporter leaves the BatchNorms to us.
EXPECTED_RULES = {
    ("decoder", "torchscript"): {"fold_bn_into_convtranspose", "fold_bn_into_convtranspose_bias", "fold_bn_into_next_conv_bias"},
    ("decoder", "dynamo"): {"fold_bn_into_next_conv_bias"},
    ("tabular", "torchscript"): {"fold_bn_into_gemm_bias", "fold_bn_into_matmul"},
}


def check_bundle(out: Path, input_names: list[str]) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    report = json.loads((out / "report.json").read_text())
    for name, entry in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == entry["sha256"], name
    assert report["verdict"] == "pass" and manifest["validation"]["passed"]
    assert len(report["validation"]["batch_sizes"]) >= 2
    model = onnx.load(out / "model.onnx")
    assert [i.name for i in model.graph.input] == input_names
    assert all(i.type.tensor_type.shape.dim[0].dim_param for i in model.graph.input), "batch must be dynamic"
    assert (out / "report.html").read_text().count("PASS") >= 1
    return report


# The TorchScript exporter (the fallback) on the models whose graphs differ where it matters: its own
# BatchNorm placement (EXPECTED_RULES), a plain CNN and a pre-activation net with deploykit ops; every
# model goes through the default exporter.
TORCHSCRIPT = ("resnet18", "resnetv2_18", "decoder", "tabular")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "exporter"), [(name, "dynamo") for name in MODELS]
                         + [(name, "torchscript") for name in TORCHSCRIPT])
def test_convert_model(tmp_path, name, exporter):
    spec, custom_ops = MODELS[name]
    save_ddp_state_dict(name, tmp_path / "weights.pt")
    result = convert(
        tmp_path, "weights.pt", "--factory", f"model_zoo:{name}", "--input", spec,
        "--batch", "1:2:3", "--exporter", exporter, "-o", "bundle",
    )
    assert result.returncode == 0, result.stderr
    report = check_bundle(tmp_path / "bundle", [spec.split(":")[0]])
    assert report["graph"]["batch_norm_after"] == 0
    assert custom_op_counts(report) == custom_ops
    fired = {rule for p in report["passes"] if p["name"] == "fold_batch_norm" for rule in p["changes"]}
    assert EXPECTED_RULES.get((name, exporter), set()) <= fired
    if custom_ops:  # our kernels and the ONNX function fallback were both validated
        labels = [c["label"] for c in report["validation"]["candidates"]]
        assert labels == ["deploykit graph + op library", "deploykit graph, ONNX functions", "plain export"]
        assert (tmp_path / "bundle" / report["custom_ops"]["library"]).exists()
    assert "PASS" in result.stderr and "report.html" in result.stderr


def test_no_custom_ops_keeps_plain_onnx(tmp_path):
    save_ddp_state_dict("resnetv2_18", tmp_path / "weights.pt")
    result = convert(
        tmp_path, "weights.pt", "--factory", "model_zoo:resnetv2_18", "--input", "x:2x3x40x40",
        "--no-custom-ops", "-o", "bundle",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "bundle" / "report.json").read_text())
    assert report["graph"]["batch_norm_after"] == 9 and not custom_op_counts(report)
    assert sorted(p.name for p in (tmp_path / "bundle").iterdir()) == ["manifest.json", "model.onnx", "report.html", "report.json"]


def test_sync_batch_norm_checkpoint(tmp_path):
    """A DDP checkpoint of a SyncBatchNorm model loads into plain BatchNorm and folds."""
    save_ddp_state_dict("resnet18", tmp_path / "weights.pt")
    result = convert(
        tmp_path, "weights.pt", "--factory", "model_zoo:resnet18_sync_batch_norm",
        "--input", "x:2x3x40x40", "-o", "bundle",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "bundle" / "report.json").read_text())
    assert report["verdict"] == "pass" and report["graph"]["batch_norm_after"] == 0


def test_torchscript_file(tmp_path):
    torch.manual_seed(0)
    model = randomize_batch_norm(model_zoo.decoder(), seed=2)
    torch.jit.save(torch.jit.trace(model, torch.randn(1, 8, 7, 5)), tmp_path / "model.pt")
    result = convert(tmp_path, "model.pt", "--input", "x:1x8x7x5", "--batch", "1:4:5", "-o", "bundle")
    assert result.returncode == 0, result.stderr
    report = check_bundle(tmp_path / "bundle", ["x"])
    assert report["export"]["exporter"] == "torchscript"
    assert report["validation"]["batch_sizes"] == [1, 4, 5]


def save_program(tmp_path: Path) -> Path:
    """A torch.export program of mobilenet_v3_small with a dynamic batch of 1..8."""
    model = model_zoo.trained_like("mobilenet_v3_small", seed=3)
    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(model, (torch.randn(2, 3, 48, 40),), dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, tmp_path / "model.pt2")
    return tmp_path / "model.pt2"


def test_exported_program_with_user_inputs(tmp_path):
    """A .pt2 needs no --input; validation runs on the user's .npz at sizes within it."""
    save_program(tmp_path)
    data = torch.randn(5, 3, 48, 40).numpy()
    np.savez(tmp_path / "data.npz", x=data)
    result = convert(tmp_path, "model.pt2", "--batch", "1:2:8", "--inputs", "data.npz", "-o", "bundle", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["validation"]["batch_sizes"] == [1, 2, 5]
    assert report["model"]["kind"] == "exported_program"
    check_bundle(tmp_path / "bundle", ["x"])


@pytest.mark.slow
def test_validation_failure_names_output_and_tolerance(tmp_path):
    """Impossible tolerances fail with exit 1, naming the output and a tolerance that passes."""
    save_program(tmp_path)
    result = convert(tmp_path, "model.pt2", "--tolerance", "output:atol=0,rtol=0,min_cosine=1", "-o", "bundle")
    assert result.returncode == 1, result.stderr
    assert "output output (batch 2)" in result.stderr and "would pass" in result.stderr
    report = json.loads((tmp_path / "bundle" / "report.json").read_text())
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert report["verdict"] == "fail" and manifest["validation"]["passed"] is False
    suggested = re.search(r"atol=([0-9.e+-]+) would pass", result.stderr).group(1)
    rerun = convert(tmp_path, "model.pt2", "--tolerance", f"atol={suggested},rtol=0,min_cosine=0.99", "-o", "again")
    assert rerun.returncode == 0, rerun.stderr


def test_fp32_rounding_of_the_model_itself_passes_by_float64(tmp_path):
    """A model whose own fp32 rounding exceeds the fp32 tolerance passes (pass*) when the graph
    is as close to float64 as PyTorch fp32 is; a tolerance the user sets is kept as given."""
    torch.save(model_zoo.cancelling().state_dict(), tmp_path / "weights.pt")
    args = ["weights.pt", "--factory", "model_zoo:cancelling", "--input", "x:1x64", "--batch", "1:3:4"]
    result = convert(tmp_path, *args, "-o", "bundle")
    assert result.returncode == 0, result.stderr
    assert "pass*" in result.stderr
    report = check_bundle(tmp_path / "bundle", ["x"])
    outputs = [o for run in report["validation"]["candidates"][0]["runs"] for o in run["outputs"]]
    assert all(o["waived"] and o["failures"] == [] for o in outputs)  # every batch misses PyTorch fp32
    judged = [o["metrics"]["float64"] for o in outputs]
    assert all(j["max_abs"] <= 4 * j["fp32_max_abs"] and j["pytorch_fp32_max_abs"] > 1e-3 for j in judged)
    assert report["notes"] and "Passed within fp32 rounding" in (tmp_path / "bundle" / "report.html").read_text()
    strict = convert(tmp_path, *args, "--tolerance", "atol=1e-4", "-o", "strict")
    assert strict.returncode == 1, strict.stderr


def test_two_inputs_with_dtypes_and_opset(tmp_path):
    """Several --input options (one int64), declared in any order, and an explicit --opset."""
    save_ddp_state_dict("image_and_tokens", tmp_path / "weights.pt")
    args = ["weights.pt", "--factory", "model_zoo:image_and_tokens", "--input", "ids:1x6:int64",
            "--input", "image:1x3x15x11", "--batch", "1:3:4", "--opset", "17", "-o", "bundle"]
    refused = convert(tmp_path, *args)  # the dynamo exporter writes opset 18 at least
    assert refused.returncode == 2 and "not the requested 17" in refused.stderr
    result = convert(tmp_path, *args, "--exporter", "torchscript")
    assert result.returncode == 0, result.stderr
    check_bundle(tmp_path / "bundle", ["image", "ids"])
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert [(i["name"], i["dtype"]) for i in manifest["inputs"]] == [("image", "float32"), ("ids", "int64")]
    assert manifest["opset"] == 17
    model = onnx.load(tmp_path / "bundle" / "model.onnx")
    assert {o.domain: o.version for o in model.opset_import}[""] == 17
