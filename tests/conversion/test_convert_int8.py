"""``deploykit convert --precision int8``: ONNX Runtime's static quantization, through the CLI.

The models' BatchNorm statistics are measured on random inputs (``calibrate_batch_norm``), as
training leaves them; the calibration samples are random too, but given with ``--calibration``
they stand for a user's data.
"""

import json
import subprocess

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import deploykit
import model_zoo
from deploykit.testing import calibrate_batch_norm
from deploykit.validation.compare import compare_output, parse_tolerances
from cpp_runtime import built_runtime
from deploykit_cli import assert_rejected, convert, run_deploykit

IMAGE = "x:1x3x16x16"


def _save_weights(directory, name: str, shape: tuple) -> None:
    torch.manual_seed(0)
    model = calibrate_batch_norm(getattr(model_zoo, name)(), [torch.randn(32, *shape)], seed=1)
    torch.save(model.state_dict(), directory / "weights.pt")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """residual_conv converted to int8 with 64 calibration samples, batch 1:4:8: (folder, result)."""
    folder = tmp_path_factory.mktemp("int8")
    _save_weights(folder, "residual_conv", (3, 16, 16))
    samples = np.random.default_rng(5).standard_normal((64, 3, 16, 16), dtype=np.float32)
    np.savez(folder / "calibration.npz", x=samples)
    result = convert(folder, "weights.pt", "--factory", "model_zoo:residual_conv", "--input", IMAGE,
                     "--batch", "1:4:8", "--precision", "int8", "--calibration", "calibration.npz", "-o", "bundle")
    return folder, result


def test_int8_with_calibration_passes(calibrated):
    folder, result = calibrated
    assert result.returncode == 0, result.stderr
    report = json.loads((folder / "bundle" / "report.json").read_text())
    manifest = json.loads((folder / "bundle" / "manifest.json").read_text())
    assert report["verdict"] == "pass" and manifest["precision"] == "int8"
    precision = report["precision"]
    assert precision["calibration"] == {"source": "calibration.npz", "samples": 64, "batches": 16}
    assert manifest["quantization"]["calibration_method"] == "minmax"
    assert set(manifest["quantization"]["quantized_nodes"]) == set(precision["quantized_nodes"])
    tolerance = report["validation"]["candidates"][0]["runs"][0]["outputs"][0]["tolerance"]
    assert tolerance["atol"] is None and tolerance["min_cosine"] == 0.99 and tolerance["min_top1"] == 0.95
    model = onnx.load(folder / "bundle" / "model.onnx")
    assert model.ir_version <= 13
    ops = {node.op_type for node in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops and "MatMulRelu" not in ops  # Linear+ReLU runs in int8
    quantized = {node.op_type for node in model.graph.node if node.name in precision["quantized_nodes"]}
    assert {"Conv", "Gemm", "Add"} <= quantized
    passes = [p["name"] for p in report["passes"]]
    assert "fuse_batch_norm" in passes and not {"fuse_matmul_relu", "ort_fusions"} & set(passes)
    assert "Precision: int8" in result.stderr and "PASS" in result.stderr


def test_custom_op_stays_float_between_dequantize_and_quantize(calibrated):
    folder, _ = calibrated
    report = json.loads((folder / "bundle" / "report.json").read_text())
    floats = {n["op"]: n["reason"] for n in report["precision"]["float_nodes"]}
    assert floats["deploykit::FusedBatchNorm"].startswith("deploykit op")
    model = onnx.load(folder / "bundle" / "model.onnx")
    producers = {out: node.op_type for node in model.graph.node for out in node.output}
    fused = next(node for node in model.graph.node if node.op_type == "FusedBatchNorm")
    assert producers[fused.input[0]] == "DequantizeLinear"  # it reads the dequantized int8 sum
    assert all(model.graph.initializer[i].data_type == onnx.TensorProto.FLOAT for i in range(len(model.graph.initializer))
               if model.graph.initializer[i].name in fused.input)
    assert "int8 + op library" in report["validation"]["candidates"][0]["label"]


def test_int8_bundle_runs_in_plain_onnxruntime_and_deploykit_load(calibrated):
    folder, _ = calibrated
    bundle = folder / "bundle"
    x = np.random.default_rng(11).standard_normal((3, 3, 16, 16), dtype=np.float32)
    session = ort.InferenceSession(str(bundle / "model.onnx"), providers=["CPUExecutionProvider"])
    plain = session.run(None, {"x": x})[0]  # our op through its ONNX function
    loaded = deploykit.load(bundle, device="cpu")(x=x)["output"]  # our op library
    torch.manual_seed(0)
    model = model_zoo.residual_conv()
    model.load_state_dict(torch.load(folder / "weights.pt"))
    with torch.no_grad():
        reference = model.eval()(torch.from_numpy(x)).numpy()
    tolerances = parse_tolerances([], "int8", ["output"])
    for actual in (plain, loaded):
        assert compare_output("output", reference, actual, tolerances["output"]).passed
    np.testing.assert_allclose(plain, loaded, atol=1e-4)


def test_deploykit_run_runs_an_int8_bundle_as_python_does(calibrated):
    """The C++ runtime (cached by build-runtime) on the QDQ graph with our op library."""
    folder, _ = calibrated
    x = np.random.default_rng(12).standard_normal((4, 3, 16, 16), dtype=np.float32)
    np.save(folder / "x.npy", x)
    done = subprocess.run([built_runtime()["executable"], str(folder / "bundle"), "--input", f"x={folder / 'x.npy'}",
                           "-o", str(folder / "cpp")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = deploykit.load(folder / "bundle", device="cpu")(x=x)["output"]
    np.testing.assert_allclose(np.load(folder / "cpp" / "output.npy"), expected, atol=1e-5)


def test_deploykit_validate_judges_an_int8_bundle_and_debug_refuses_it(calibrated):
    folder, _ = calibrated
    validated = run_deploykit("validate", "bundle", "weights.pt", "--factory", "model_zoo:residual_conv", cwd=folder)
    assert validated.returncode == 0 and "PASS" in validated.stderr, validated.stderr
    assert_rejected(run_deploykit("debug", "bundle", cwd=folder), "does not examine int8 bundles yet")


def test_int8_json_report_stays_clean_with_a_histogram_method(tmp_path):
    """entropy and percentile calibration print progress on stdout, which carries --json's report."""
    _save_weights(tmp_path, "tiny_conv", (3, 8, 8))
    np.savez(tmp_path / "calibration.npz", x=np.random.default_rng(3).standard_normal((16, 3, 8, 8), dtype=np.float32))
    result = convert(tmp_path, "weights.pt", "--factory", "model_zoo:tiny_conv", "--input", "x:1x3x8x8", "--precision",
                     "int8", "--calibration", "calibration.npz", "--calibration-method", "entropy", "--json", "-o", "b")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"] == "pass" and report["precision"]["calibration_method"] == "entropy"
    assert report["precision"]["calibration"] == {"source": "calibration.npz", "samples": 16, "batches": 16}


def test_int8_without_calibration_is_inconclusive(tmp_path):
    _save_weights(tmp_path, "tiny_conv", (3, 8, 8))
    result = convert(tmp_path, "weights.pt", "--factory", "model_zoo:tiny_conv", "--input", "x:1x3x8x8",
                     "--precision", "int8", "-o", "bundle")
    assert result.returncode == 5, result.stderr
    assert "calibrated on random inputs" in result.stderr and "--calibration data.npz" in result.stderr
    assert "INCONCLUSIVE" in result.stderr and "Traceback" not in result.stderr
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert "random inputs" in manifest["quantization"]["calibration"]["note"]
    assert "random inputs" in manifest["validation"]["inconclusive"]["output"]
    report = json.loads((tmp_path / "bundle" / "report.json").read_text())
    assert report["verdict"] == "inconclusive" and "random inputs" in report["summary"]
    inspected = run_deploykit("inspect", "bundle", cwd=tmp_path, columns=200)
    assert "inconclusive for output output: the int8 scales were calibrated on random inputs" in inspected.stderr
    assert "int8: 4 nodes quantized, 0 float" in inspected.stderr


@pytest.mark.parametrize("arrays, words", [
    ({"images": (4, 3, 8, 8)}, ["--calibration", "lacks x", "name the arrays after the model's inputs"]),
    ({"x": (4, 3, 9, 8)}, ["--calibration", "x has shape 4x3x9x8", "the model takes 1x3x8x8"]),
])
def test_bad_calibration_file_is_one_line_exit_2(tmp_path, arrays, words):
    _save_weights(tmp_path, "tiny_conv", (3, 8, 8))
    np.savez(tmp_path / "calibration.npz", **{name: np.zeros(shape, np.float32) for name, shape in arrays.items()})
    result = convert(tmp_path, "weights.pt", "--factory", "model_zoo:tiny_conv", "--input", "x:1x3x8x8",
                     "--precision", "int8", "--calibration", "calibration.npz", "-o", "bundle")
    assert_rejected(result, *words)
    assert len([line for line in result.stderr.splitlines() if "error" in line]) == 1
    assert not (tmp_path / "bundle").exists()


def test_calibration_samples_the_model_cannot_run_are_one_line_exit_2(tmp_path):
    """Token ids beyond the vocabulary fail inside ONNX Runtime's calibration: the user's data, not a bug."""
    torch.manual_seed(0)
    torch.save(model_zoo.bert_tiny().state_dict(), tmp_path / "weights.pt")
    ids = np.full((4, 16), 5000, np.int64)  # bert_tiny's vocabulary has 1000 tokens
    np.savez(tmp_path / "calibration.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    result = convert(tmp_path, "weights.pt", "--factory", "model_zoo:bert_tiny", "--input", "input_ids:1x16:int64",
                     "--input", "attention_mask:1x16:int64", "--precision", "int8", "--calibration",
                     "calibration.npz", "-o", "bundle")
    assert_rejected(result, "--calibration", "the model does not run on these samples", "out of data bounds",
                    "token ids within the vocabulary")
    assert not (tmp_path / "bundle").exists()


@pytest.mark.parametrize("args, words", [
    (["--precision", "int8", "--backend", "aoti"], ["--backend aoti is not supported with --precision int8"]),
    (["--calibration", "data.npz"], ["--calibration and --calibration-method apply to int8"]),
])
def test_int8_refuses_what_it_does_not_do_yet(tmp_path, args, words):
    result = convert(tmp_path, "weights.pt", "--input", "x:1x3x8x8", *args, "-o", "bundle")
    assert_rejected(result, *words)


def test_auto_fix_keeps_the_nodes_int8_breaks_in_float(tmp_path):
    """A hidden feature 200x the others makes one uint8 scale crush the rest, so plain int8 fails; --auto-fix
    ranks the head first, keeps it and the Relu that quantizes its input in float, passes, says so in the
    console and the report, and the bundle runs in deploykit.load as validated. Where no round can pass (a
    cosine of exactly 1 asked), every round is tried and the fully quantized graph ships, failing (exit 1)."""
    torch.manual_seed(0)
    model = model_zoo.outlier_feature().eval()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    np.savez(tmp_path / "calibration.npz", x=np.random.default_rng(5).standard_normal((64, 16), dtype=np.float32))
    args = ["weights.pt", "--factory", "model_zoo:outlier_feature", "--input", "x:1x16", "--batch", "1:4:8",
            "--precision", "int8", "--calibration", "calibration.npz"]
    fixed = convert(tmp_path, *args, "--auto-fix", "-o", "fixed")
    assert fixed.returncode == 0, fixed.stderr
    assert "auto-fix round 1: 2 nodes in float, pass" in fixed.stderr and "auto-fix: passed" in fixed.stderr
    precision = json.loads((tmp_path / "fixed" / "report.json").read_text())["precision"]
    fix = precision["auto_fix"]
    head = next(node for node in onnx.load(tmp_path / "fixed" / "model.fp32.onnx").graph.node
                if "output" in node.output)
    assert fix["kept_float"][0]["node"] == head.name and fix["kept_float"][0]["op"] == "Gemm"
    assert [r["passed"] for r in fix["rounds"]] == [True] and fix["quantized_ms"] > 0
    assert "--auto-fix: passed with 2 node(s) in float" in (tmp_path / "fixed" / "report.html").read_text()
    assert {n["op"] for n in precision["float_nodes"]} == {"Gemm", "Relu"} and precision["nodes"]["int8"] == 1
    shipped = onnx.load(tmp_path / "fixed" / "model.onnx").graph
    (head_after,) = [node for node in shipped.node if node.name == head.name]
    producers = {output: node.op_type for node in shipped.node for output in node.output}
    assert "DequantizeLinear" not in {producers.get(name) for name in head_after.input}, "the head reads float"
    x = np.random.default_rng(7).standard_normal((5, 16), dtype=np.float32)
    with torch.no_grad():
        reference = model(torch.from_numpy(x)).numpy()
    tolerances = parse_tolerances([], "int8", ["output"])
    assert compare_output("output", reference, deploykit.load(tmp_path / "fixed", device="cpu")(x=x)["output"],
                          tolerances["output"]).passed
    hopeless = convert(tmp_path, *args, "--auto-fix", "--tolerance", "min_cosine=1", "-o", "hopeless")
    assert hopeless.returncode == 1, hopeless.stderr
    assert "still failing with the 2 worst of 2 matrix products in float" in hopeless.stderr
    precision = json.loads((tmp_path / "hopeless" / "report.json").read_text())["precision"]
    assert [r["passed"] for r in precision["auto_fix"]["rounds"]] == [False, False]
    assert precision["nodes"] == {"int8": 3, "float": 0} and precision["auto_fix"]["kept_float"] == []


def test_auto_fix_on_random_calibration_stays_inconclusive(tmp_path):
    """Without --calibration, a round of auto-fix that passes proves no more than the first quantization: the
    verdict stays inconclusive (exit 5), as it is without auto-fix."""
    torch.manual_seed(0)
    torch.save(model_zoo.outlier_feature().eval().state_dict(), tmp_path / "weights.pt")
    result = convert(tmp_path, "weights.pt", "--factory", "model_zoo:outlier_feature", "--input", "x:1x16",
                     "--batch", "1:4:8", "--precision", "int8", "--auto-fix", "-o", "bundle")
    assert result.returncode == 5, result.stderr
    assert "auto-fix: passed with 2 node(s) in float" in result.stderr
    report = json.loads((tmp_path / "bundle" / "report.json").read_text())
    assert report["verdict"] == "inconclusive" and report["precision"]["auto_fix"]["kept_float"]


def test_auto_fix_rounds_and_the_ops_that_feed_a_kept_node():
    from deploykit.conversion.quantize import QUANTIZED_OPS
    from deploykit.conversion.quantize_fix import round_sizes, with_feeding_ops

    assert round_sizes(40, 16) == [1, 2, 4, 8, 16] and round_sizes(5, 16) == [1, 2, 4, 5]
    assert round_sizes(1, 16) == [1] and round_sizes(0, 16) == []
    nodes = [onnx.helper.make_node("Conv", ["x", "w"], ["a"], name="conv"),
             onnx.helper.make_node("Relu", ["a"], ["b"], name="relu"),
             onnx.helper.make_node("MaxPool", ["b"], ["c"], name="pool", kernel_shape=[2, 2]),
             onnx.helper.make_node("Softmax", ["c"], ["d"], name="softmax"),
             onnx.helper.make_node("Add", ["c", "d"], ["e"], name="add"),
             onnx.helper.make_node("Gemm", ["e", "g"], ["y"], name="head")]
    graph = onnx.helper.make_graph(nodes, "g", [], [])
    model = onnx.helper.make_model(graph)
    # the Add, pooling and Relu quantize what the head reads; the Softmax is not quantized, the Conv is a product
    assert sorted(with_feeding_ops(model, ["head"], QUANTIZED_OPS)) == ["add", "head", "pool", "relu"]


def test_int8_tolerances_judge_by_cosine_and_top1():
    """A 5% error of every logit passes (cosine 1); a swapped top class fails; --tolerance adds atol."""
    reference = np.array([[4.0, 1.0, 0.5], [0.1, 3.0, 0.2]], np.float32)
    scaled = compare_output("y", reference, reference * 1.05, parse_tolerances([], "int8", ["y"])["y"])
    assert scaled.passed and scaled.metrics["max_abs"] > 0.1
    swapped = reference[:, [1, 0, 2]] * 0.999 + reference * 0.001
    assert not compare_output("y", reference, swapped, parse_tolerances([], "int8", ["y"])["y"]).passed
    strict = parse_tolerances(["atol=0.01"], "int8", ["y"])["y"]
    assert strict.min_cosine == 0.99 and not compare_output("y", reference, reference * 1.05, strict).passed


def test_int8_top1_sets_near_ties_aside_but_counts_decided_flips():
    """40 rows of 10 logits, noise of RMS 0.01: a row whose lead is 0.01 may flip (a near tie); a
    row whose lead is 0.3 flipped by an error in that row alone is a real disagreement."""
    rng = np.random.default_rng(0)
    reference = rng.standard_normal((40, 10))
    reference[:, 0] = reference.max(1) + 0.3  # every row has a clear leader ...
    reference[:4, 1] = reference[:4, 0] - 0.01  # ... but four lead by 0.01 only
    candidate = reference + rng.normal(0, 0.01, reference.shape)
    candidate[:4, 1] = candidate[:4, 0] + 0.005  # the near ties flip
    default = parse_tolerances([], "int8", ["y"])["y"]
    result = compare_output("y", reference, candidate, default)
    assert result.passed and result.metrics["top1_near_ties"] == 4 and result.metrics["top1_agreement"] == 0.9
    every_row = parse_tolerances(["top1_tie_margin=0"], "int8", ["y"])["y"]
    assert not compare_output("y", reference, candidate, every_row).passed
    flipped = candidate.copy()
    flipped[4:7, 0] = flipped[4:7, 1:].max(1) - 0.01  # three decided rows disagree: 33/36 < 0.95
    failed = compare_output("y", reference, flipped, default)
    assert failed.metrics["cosine"] > 0.99 and failed.failures == [
        "top-1 agreement 0.9167 (over the rows that are no near tie; 4 near ties) < min_top1=0.95"]
