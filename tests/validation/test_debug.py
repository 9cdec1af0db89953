"""Layer-wise comparison and auto-fix (deploykit/validation/layerwise.py, auto_fix.py, ``deploykit debug``, ``--auto-fix``).

Two models of model_zoo that plain fp16 conversion gets wrong, for the two reasons users meet most:
LayerNorm over large activations (the values fit fp16 but their spread does not survive its
rounding) and a sum that overflows fp16 on real-scale data. Both must fail, be diagnosed by
name, and pass once the named nodes are pinned to fp32.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import helper

from deploykit.validation.auto_fix import FixProblem, auto_fix, find_culprits
from deploykit.validation.compare import Tolerance, parse_tolerances
from deploykit.validation.layerwise import compare_layers, run_values
from deploykit.passes.precision import apply_precision, emulate, name_nodes
from deploykit.tools.debug import open_bundle
from deploykit_cli import convert, run_deploykit
from model_zoo import ACTIVATION_OFFSET, large_activation_norm, sum_pooling
from onnx_graphs import make_model, tensor


def save(tmp_path, factory) -> str:
    torch.manual_seed(0)
    torch.save(factory().state_dict(), tmp_path / "weights.pt")
    return "weights.pt"


def read(bundle) -> tuple[dict, dict]:
    return json.loads((bundle / "report.json").read_text()), json.loads((bundle / "manifest.json").read_text())


def deploykit_debug(cwd, *args: str) -> subprocess.CompletedProcess:
    return run_deploykit("debug", *args, cwd=cwd, columns=200, timeout=600)


def reader_of(model: onnx.ModelProto, op_type: str) -> str:
    """Name of the node that computes the input of the first ``op_type`` node."""
    target = next(n for n in model.graph.node if n.op_type == op_type)
    return next(n.name for n in model.graph.node if target.input[0] in n.output)


def node_of(model: onnx.ModelProto, op_type: str) -> str:
    """Name of the first ``op_type`` node."""
    return next(n.name for n in model.graph.node if n.op_type == op_type)


# --- LayerNorm over large activations -------------------------------------------------------------

LN_ARGS = ("--factory", "model_zoo:large_activation_norm", "--input", "x:1x16", "--batch", "1:2:4", "--precision", "fp16")


@pytest.fixture(scope="module")
def failing_ln_bundle(tmp_path_factory):
    """Plain fp16 conversion of LargeActivationNorm: it fails, and writes its bundle."""
    tmp_path = tmp_path_factory.mktemp("ln")
    result = convert(tmp_path, save(tmp_path, large_activation_norm), *LN_ARGS, "-o", "bundle")
    return tmp_path, result


def test_layer_norm_over_large_activations_fails_plain_fp16(failing_ln_bundle):
    tmp_path, result = failing_ln_bundle
    assert result.returncode == 1, result.stderr
    report, manifest = read(tmp_path / "bundle")
    assert report["verdict"] == "fail" and manifest["precision"] == "fp16"
    # LayerNorm is not pinned (ONNX Runtime's kernel keeps its statistics in fp32): its fp16 input breaks it
    assert "LayerNormalization" not in {n["op"] for n in report["precision"]["fp32_nodes"]}
    assert "fp16 lost the accuracy: deploykit debug BUNDLE names the nodes" in result.stderr
    worst = min(o["metrics"]["cosine"] for r in report["validation"]["candidates"][0]["runs"] for o in r["outputs"])
    assert worst < 0.9


def test_convert_auto_fix_pins_the_node_feeding_layer_norm(tmp_path):
    result = convert(tmp_path, save(tmp_path, large_activation_norm), *LN_ARGS, "--auto-fix", "-o", "bundle")
    assert result.returncode == 0, result.stderr
    report, manifest = read(tmp_path / "bundle")
    assert report["verdict"] == "pass" and manifest["validation"]["passed"]
    fix = report["precision"]["auto_fix"]
    fp32_graph = onnx.load(tmp_path / "bundle" / "model.fp32.onnx")
    embed, norm = reader_of(fp32_graph, "LayerNormalization"), node_of(fp32_graph, "LayerNormalization")
    # LayerNorm computes in fp32 inside but reads fp16: it and the Gemm feeding it both go fp32
    assert [(p["node"], p["op"]) for p in fix["pinned"]] == [(embed, "Gemm"), (norm, "LayerNormalization")]
    pin = fix["pinned"][0]
    assert "LayerNormalization" in pin["reason"] and "diverges first" in pin["reason"]
    assert pin["symptom_before"]["cosine"] < 0.9 and pin["symptom_after"]["cosine"] > 0.9999
    assert pin["error_after"]["max_abs"] == 0.0  # the pinned node now matches fp32 exactly
    assert fix["passed"] and fix["stopped"] == "outputs pass"
    assert fix["outputs_before"]["output"]["cosine"] < 0.9 < 0.9999 < fix["outputs_after"]["output"]["cosine"]
    assert fix["tradeoff"]["fp32_nodes"] == 2 and 0 < fix["tradeoff"]["fp32_share_of_multiply_adds"] < 1
    assert f"auto-fix pinned {embed} (Gemm)" in result.stderr
    page = (tmp_path / "bundle" / "report.html").read_text()
    assert "<h2>Precision: fp16</h2>" in page and "--auto-fix: passed after 1 round(s)" in page
    assert f"<td class=\"name\">{embed}</td><td class=\"name\">Gemm</td>" in page
    typed = onnx.load(tmp_path / "bundle" / "model.onnx")
    assert {n.name: n.op_type for n in typed.graph.node}[embed] == "Gemm"
    head = [n for n in typed.graph.node if n.op_type == "Gemm" and n.name != embed]
    assert head and any(i.data_type == onnx.TensorProto.FLOAT16 for i in typed.graph.initializer)


def test_debug_bundle_names_the_cause_and_saves_a_graph_that_passes(failing_ln_bundle):
    tmp_path, _ = failing_ln_bundle
    result = deploykit_debug(tmp_path, "bundle", "--json", "--save", "fixed.onnx")
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    reference = onnx.load(tmp_path / "bundle" / "model.fp32.onnx")
    assert [p["node"] for p in found["pinned"]] == [reader_of(reference, "LayerNormalization"),
                                                    node_of(reference, "LayerNormalization")]
    assert found["passed"] and found["precision"] == "fp16"
    fixed = onnx.load(tmp_path / "fixed.onnx")
    x = {"x": np.random.default_rng(7).standard_normal((3, 16)).astype(np.float32)}
    expected = run_values(reference, x)["output"]
    emulated = run_values(emulate(fixed), x)["output"]
    np.testing.assert_allclose(emulated, expected, atol=1e-2, rtol=1e-2)


def test_debug_layerwise_shows_where_the_error_starts(failing_ln_bundle):
    tmp_path, _ = failing_ln_bundle
    result = deploykit_debug(tmp_path, "bundle", "--layerwise", "--json")
    assert result.returncode == 1, result.stderr  # something diverges
    layers = json.loads(result.stdout)["layers"]
    first = next(layer for layer in layers if layer["diverged"])
    assert first["op"] == "LayerNormalization" and first["cosine"] < 0.9
    embed = next(layer for layer in layers if layer["op"] == "Gemm")
    assert embed["dtype"] == "float16" and not embed["diverged"] and embed["max_abs"] <= 2.0  # one fp16 step at 3000
    table = deploykit_debug(tmp_path, "bundle", "--layerwise")
    assert "First to diverge:" in table.stderr and "LayerNormalization" in table.stderr


def test_manifest_records_io_precision_and_debug_reads_it_from_there(tmp_path):
    """--io-precision fp16 is in the manifest; debug's fix keeps it without report.json, and
    bundles written before the manifest recorded it fall back to report.json."""
    result = convert(tmp_path, save(tmp_path, large_activation_norm), *LN_ARGS, "--io-precision", "fp16",
                     "-o", "bundle")
    assert result.returncode == 1, result.stderr
    report, manifest = read(tmp_path / "bundle")
    assert manifest["io_precision"] == report["precision"]["io_precision"] == "fp16"
    assert [i["dtype"] for i in manifest["inputs"]] == ["float16"]
    shutil.copytree(tmp_path / "bundle", tmp_path / "older")
    (tmp_path / "bundle" / "report.json").unlink()
    fixed = deploykit_debug(tmp_path, "bundle", "--json", "--save", "fixed.onnx")
    assert fixed.returncode == 0, fixed.stderr
    assert json.loads(fixed.stdout)["passed"]
    graph = onnx.load(tmp_path / "fixed.onnx").graph
    assert {v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]} == {onnx.TensorProto.FLOAT16}
    older = tmp_path / "older" / "manifest.json"
    older.write_text(json.dumps({k: v for k, v in json.loads(older.read_text()).items() if k != "io_precision"}))
    assert open_bundle(tmp_path / "older").io_precision == "fp16"


# --- a sum that overflows fp16 ------------------------------------------------------------------

SUM_ARGS = ("--factory", "model_zoo:sum_pooling", "--input", "x:1x256x32", "--batch", "1:2:4",
            "--precision", "fp16", "--inputs", "data.npz")


def raw_scale_data(tmp_path) -> np.ndarray:
    """Readings in raw units (standard deviation 1000), as a user's --inputs may hold."""
    data = (np.random.default_rng(5).standard_normal((4, 256, 32)) * 1000).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=data)
    return data


def test_fp16_sum_overflow_fails_and_auto_fix_pins_its_reader(tmp_path):
    data = raw_scale_data(tmp_path)
    weights = save(tmp_path, sum_pooling)
    model = sum_pooling()
    model.load_state_dict(torch.load(tmp_path / weights))
    with torch.no_grad():
        pooled = torch.relu(model.proj(torch.from_numpy(data))).sum(dim=1)
    assert pooled.abs().max() > 65504, "the premise: this data overflows fp16 after the sum"

    plain = convert(tmp_path, weights, *SUM_ARGS, "-o", "plain")
    assert plain.returncode == 1, plain.stderr
    report, _ = read(tmp_path / "plain")
    assert "NaN in one result but not the other" in " ".join(report["failures"])
    reasons = {n["node"]: n["reason"] for n in report["precision"]["fp32_nodes"]}
    assert list(reasons.values()) == ["sum/mean over 256 elements"]  # calibration saw no large value

    fixed = convert(tmp_path, weights, *SUM_ARGS, "--auto-fix", "-o", "fixed")
    assert fixed.returncode == 0, fixed.stderr
    report, manifest = read(tmp_path / "fixed")
    assert report["verdict"] == "pass" and manifest["validation"]["passed"]
    (pin,) = report["precision"]["auto_fix"]["pinned"]
    graph = onnx.load(tmp_path / "fixed" / "model.fp32.onnx").graph
    head = next(n for n in graph.node if n.op_type == "Gemm")
    assert (pin["node"], pin["op"]) == (head.name, "Gemm")
    assert "overflows to Inf/NaN when cast to float16" in pin["reason"]
    assert pin["error_before"]["new_inf_nan"] > 0 and pin["error_after"]["new_inf_nan"] == 0
    assert report["precision"]["auto_fix"]["outputs_before"]["output"]["nan"] > 0
    # the matrix product before the sum (our MatMulRelu) stays fp16: fp32 is a sliver of the work
    assert report["precision"]["tradeoff"]["fp32_share_of_multiply_adds"] < 0.01
    assert "deploykit::MatMulRelu" in {op["name"] for op in report["graph"]["ops"] if op["after"]}


# --- layer-wise comparison of fp32 bundles --------------------------------------------------------


def test_layerwise_finds_the_first_differing_node_of_an_fp32_bundle(tmp_path):
    """fp32: the bundle as deployed (our MatMulRelu kernel) against its ONNX semantics, then
    against a graph whose head weight differs: that Gemm is the first node to diverge."""
    result = convert(tmp_path, save(tmp_path, sum_pooling), "--factory", "model_zoo:sum_pooling",
                     "--input", "x:2x256x32", "-o", "bundle")
    assert result.returncode == 0, result.stderr
    same = deploykit_debug(tmp_path, "bundle", "--json")
    assert same.returncode == 0, same.stderr
    layers = json.loads(same.stdout)["layers"]
    assert [l["op"] for l in layers] == ["MatMulRelu", "ReduceSum", "Gemm"] and not any(l["diverged"] for l in layers)
    altered = onnx.load(tmp_path / "bundle" / "model.onnx")
    head = next(n for n in altered.graph.node if n.op_type == "Gemm")
    weight = next(i for i in altered.graph.initializer if i.name == head.input[1])
    values = onnx.numpy_helper.to_array(weight).copy()
    values[0, 3] += 0.05
    weight.CopyFrom(onnx.numpy_helper.from_array(values, weight.name))
    onnx.save(altered, tmp_path / "altered.onnx")
    differs = deploykit_debug(tmp_path, "bundle", "--json", "--reference", "altered.onnx")
    assert differs.returncode == 1, differs.stderr
    first = next(l for l in json.loads(differs.stdout)["layers"] if l["diverged"])
    assert (first["node"], first["op"]) == (head.name, "Gemm")


# --- the pieces, on hand-built graphs -------------------------------------------------------------


def stacked_norms(stages: int) -> onnx.ModelProto:
    """``stages`` x (Gemm with a bias of 3000 -> LayerNorm), then a Gemm: each Gemm needs fp32."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(stages):
        nodes += [helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [f"g{i}"], name=f"gemm{i}"),
                  helper.make_node("LayerNormalization", [f"g{i}", "one", "zero"], [f"n{i}"], name=f"norm{i}")]
        inits += [tensor(f"w{i}", rng.normal(0, 0.15, (16, 16))), tensor(f"b{i}", np.full(16, ACTIVATION_OFFSET))]
        x = f"n{i}"
    nodes.append(helper.make_node("Gemm", [x, "head"], ["y"], name="head"))
    inits += [tensor("one", np.ones(16)), tensor("zero", np.zeros(16)), tensor("head", rng.normal(0, 0.3, (16, 5)))]
    return name_nodes(make_model(nodes, inits, {"x": ["N", 16]}, {"y": 2}))


def fix_problem(model: onnx.ModelProto) -> FixProblem:
    feeds = {"x": np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)}
    expected = {"y": run_values(model, feeds)["y"]}
    return FixProblem(model, "fp16", None, {}, feeds, expected, parse_tolerances([], "fp16", ["y"]))


def test_find_culprits_blames_the_reduced_precision_input_of_an_fp32_node():
    model = stacked_norms(1)
    typed = apply_precision(model, "fp16", target="tensorrt")  # TensorRT's plan: LayerNorm is an fp32 node
    feeds = fix_problem(model).feeds
    graph = ir.serde.deserialize_graph(typed.model.graph)
    diffs = compare_layers(graph, run_values(model, feeds), run_values(emulate(typed.model), feeds),
                           Tolerance.for_precision("fp16"))
    first = next(d for d in diffs if d.diverged)
    assert (first.node, first.op) == ("norm0", "LayerNormalization")
    (culprit,) = find_culprits(graph, diffs, {n.name for n in model.graph.node})
    assert culprit.node == "gemm0" and culprit.symptom.node == "norm0"


def test_auto_fix_stops_at_the_bound_on_pinned_nodes():
    bounded = auto_fix(fix_problem(stacked_norms(2)), max_pinned=1)
    assert not bounded.passed and bounded.stopped == "the bound of 1 pinned nodes is reached"
    assert [p.node for p in bounded.pinned] == ["gemm0"]
    assert bounded.failures
    enough = auto_fix(fix_problem(stacked_norms(2)), max_pinned=4)
    assert enough.passed and [(p.node, p.round) for p in enough.pinned] == [
        ("gemm0", 1), ("norm0", 1), ("gemm1", 2), ("norm1", 2)]
    assert enough.outputs_after["y"]["cosine"] > 0.9999 > enough.outputs_before["y"]["cosine"]
