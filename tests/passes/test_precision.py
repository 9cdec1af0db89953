"""The fp16/bf16 pass (deploykit/passes/precision.py), its CPU emulation, and whole models.

Hand-built graphs check the typing rules; resnet18 and a small transformer go through
``deploykit convert --precision`` with the tolerances of docs/precision.md; TensorRT-RTX must
parse the typed graph as a strongly typed network with the types we wrote, and build it.
"""

from __future__ import annotations

import collections
import json

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from deploykit.errors import BadInputError
from deploykit.ops import fused_batch_norm, matmul_relu
from deploykit.passes.precision import (
    apply_precision, check_precision, emulate, float_io, name_nodes, source_name,
)
from deploykit.conversion.precision import ort_cpu_missing_kernels, typed_runner
from deploykit_cli import convert
import model_zoo
from model_zoo import save_ddp_state_dict
from onnx_graphs import make_model, run_ort, tensor

HALF, BF16, FLOAT = TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT


# --- helpers ----------------------------------------------------------------------------------


def weight(name: str, shape, scale: float = 0.3, seed: int = 0):
    return tensor(name, np.random.default_rng(seed).normal(0, scale, shape))


def attention_like() -> onnx.ModelProto:
    """x -> MatMul+Add -> LayerNorm -> MatMul -> Softmax -> MatMul -> y: three fp32 islands."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], name="mm1"),
        helper.make_node("Add", ["m1", "b1"], ["h"], name="add1"),
        helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["n"], name="ln", axis=-1),
        helper.make_node("MatMul", ["n", "w2"], ["s"], name="mm2"),
        helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "w3"], ["y"], name="mm3"),
    ]
    inits = [weight("w1", (16, 16)), weight("b1", (16,), seed=1), tensor("gamma", np.ones(16)),
             tensor("beta", np.zeros(16)), weight("w2", (16, 16), seed=2), weight("w3", (16, 16), seed=3)]
    return make_model(nodes, inits, {"x": ["N", 8, 16]}, {"y": 3})


def node_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of each node's first output, by node name."""
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.value_info, *model.graph.output]}
    return {node.name: types.get(node.output[0]) for node in model.graph.node}


def casts(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if node.op_type == "Cast"]


def assert_casts_only_at_boundaries(model: onnx.ModelProto) -> None:
    """No Cast reads a Cast's output, and each (value, type) is cast once."""
    cast_outputs = {node.output[0] for node in casts(model)}
    assert not [n.name for n in casts(model) if n.input[0] in cast_outputs], "Cast -> Cast ping-pong"
    keys = [(n.input[0], n.attribute[0].i) for n in casts(model)]
    assert len(keys) == len(set(keys)), "a value is cast to the same type twice"


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return run_ort(model, {"x": x})[0].astype(np.float32)


# --- typing rules -----------------------------------------------------------------------------


@pytest.mark.parametrize("precision, low", [("fp16", HALF), ("bf16", BF16)])
def test_sensitive_nodes_stay_fp32_and_casts_sit_at_island_boundaries(precision, low):
    result = apply_precision(attention_like(), precision, target="tensorrt")
    model = result.model
    onnx.checker.check_model(model, full_check=True)
    types = node_types(model)
    assert types["mm1"] == types["mm2"] == types["mm3"] == low
    assert types["ln"] == types["softmax"] == FLOAT
    # the bias Add costs one Cast on either side of it: ties go to fp32
    assert types["add1"] == FLOAT
    assert {(n.node, n.reason) for n in result.fp32_nodes()} == {
        ("ln", "normalisation"), ("softmax", "softmax"), ("add1", "on the fp32 side of a boundary (fewer casts)")}
    # x in, LN in and out, Softmax in and out, y out: one Cast at each boundary, none elsewhere
    assert len(casts(model)) == 6 and result.stats.changes["casts"] == 6
    assert_casts_only_at_boundaries(model)
    assert [i.type.tensor_type.elem_type for i in model.graph.input] == [FLOAT]
    assert [o.type.tensor_type.elem_type for o in model.graph.output] == [FLOAT]
    weights = {i.name: i.data_type for i in model.graph.initializer}
    assert weights["w1"] == weights["w2"] == low and weights["gamma"] == weights["b1"] == FLOAT  # names kept
    x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)
    reference = run(attention_like(), x)
    np.testing.assert_allclose(run(emulate(model), x), reference, atol=0.03, rtol=0.03)


@pytest.mark.parametrize("precision, low", [("fp16", HALF), ("bf16", BF16)])
def test_for_onnxruntime_layer_norm_runs_reduced_as_its_kernel_accumulates_in_fp32(precision, low):
    for_trt = apply_precision(attention_like(), precision, target="tensorrt")
    for_ort = apply_precision(attention_like(), precision, target="onnxruntime")
    types = node_types(for_ort.model)
    assert types["ln"] == types["add1"] == low and types["softmax"] == FLOAT
    assert {n.node for n in for_ort.fp32_nodes()} == {"softmax"}
    # x in, Softmax in and out, y out: the LayerNorm island and its two casts are gone
    assert for_ort.stats.changes["casts"] == 4 < for_trt.stats.changes["casts"] == 6
    assert_casts_only_at_boundaries(for_ort.model)
    x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32)
    np.testing.assert_allclose(run(emulate(for_ort.model), x), run(attention_like(), x), atol=0.03, rtol=0.03)


def test_a_cheap_node_between_fp32_nodes_stays_fp32_instead_of_ping_pong():
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], name="ln", axis=-1),
        helper.make_node("Mul", ["n", "temperature"], ["scaled"], name="scale"),
        helper.make_node("Softmax", ["scaled"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "w"], ["y"], name="mm"),
    ]
    inits = [tensor("gamma", np.ones(16)), tensor("beta", np.zeros(16)), tensor("temperature", [0.5]),
             weight("w", (16, 16))]
    result = apply_precision(make_model(nodes, inits, {"x": ["N", 16]}, {"y": 2}), "fp16", target="tensorrt")
    types = node_types(result.model)
    assert types["scale"] == FLOAT and types["mm"] == HALF
    assert [c.input[0] for c in casts(result.model)] == ["p", "y__fp16"]  # into mm, out of mm
    assert next(n for n in result.nodes if n.node == "scale").reason.startswith("on the fp32 side")


def test_io_precision_changes_the_signature_only():
    result = apply_precision(attention_like(), "fp16", io_precision="fp16", target="tensorrt")
    model = result.model
    onnx.checker.check_model(model, full_check=True)
    assert model.graph.input[0].type.tensor_type.elem_type == HALF
    assert model.graph.output[0].type.tensor_type.elem_type == HALF
    assert len(casts(model)) == 4  # the two boundary casts at x and y are gone
    x = np.random.default_rng(1).standard_normal((2, 8, 16)).astype(np.float32)
    np.testing.assert_allclose(run(emulate(model), x), run(attention_like(), x), atol=0.03, rtol=0.03)


@pytest.mark.parametrize("spatial, expected", [((7, 7), HALF), ((16, 16), FLOAT), (("H", "W"), FLOAT)])
def test_long_reductions_stay_fp32(spatial, expected):
    """A mean over 49 elements keeps fp16; over 256, or an unknown count, it is fp32."""
    nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["m"], name="mean", keepdims=0),
             helper.make_node("MatMul", ["m", "w"], ["y"], name="mm")]
    inits = [numpy_helper.from_array(np.array([2, 3], np.int64), "axes"), weight("w", (4, 4))]
    model = make_model(nodes, inits, {"x": ["N", 4, *spatial]}, {"y": 2})
    result = apply_precision(model, "fp16")
    assert node_types(result.model)["mean"] == expected


def test_calibration_ranges_keep_large_values_out_of_fp16():
    """A tensor beyond the safe range keeps its producer fp32, and every reader of it."""
    model = attention_like()
    result = apply_precision(model, "fp16", ranges={"h": 3e5, "m1": 10.0})
    types = node_types(result.model)
    assert types["add1"] == FLOAT and types["ln"] == FLOAT and types["mm1"] == HALF
    reasons = {n.node: n.reason for n in result.fp32_nodes()}
    assert "values up to 3e+05" in reasons["add1"]
    assert not [c for c in casts(result.model) if c.input[0] == "h"], "h must never be cast to fp16"


def test_weights_beyond_the_range_keep_their_node_fp32():
    model = attention_like()
    big = onnx.numpy_helper.to_array(model.graph.initializer[0]) * 1e6  # w1 beyond fp16's 65504
    model.graph.initializer[0].CopyFrom(tensor("w1", big))
    result = apply_precision(model, "fp16")
    assert node_types(result.model)["mm1"] == FLOAT
    assert {i.name: i.data_type for i in result.model.graph.initializer}["w1"] == FLOAT


def test_pinned_nodes_stay_fp32_with_the_reason_given():
    result = apply_precision(attention_like(), "fp16", keep_fp32={"mm2": "pinned by a test"})
    assert node_types(result.model)["mm2"] == FLOAT
    assert ("mm2", "pinned by a test") in {(n.node, n.reason) for n in result.fp32_nodes()}
    assert_casts_only_at_boundaries(result.model)


def test_custom_ops_take_the_types_their_kernels_have():
    """FusedBatchNorm has fp16 kernels only; MatMulRelu fp16 and bf16 (docs/ops.md)."""
    nodes = [
        helper.make_node("FusedBatchNorm", ["x", "scale", "bias"], ["f"], name="fbn", domain="deploykit", activation="relu"),
        helper.make_node("Flatten", ["f"], ["flat"], name="flatten"),
        helper.make_node("MatMulRelu", ["flat", "w", "b"], ["y"], name="mmr", domain="deploykit"),
    ]
    inits = [tensor("scale", np.ones(4)), tensor("bias", np.zeros(4)), weight("w", (36, 8)), tensor("b", np.zeros(8))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", FLOAT, ["N", 4, 3, 3])],
                              [helper.make_tensor_value_info("y", FLOAT, ["N", 8])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("deploykit", 1)],
                              functions=[fused_batch_norm_proto(), matmul_relu_proto()])
    fp16, bf16 = apply_precision(model, "fp16"), apply_precision(model, "bf16")
    assert node_types(fp16.model)["fbn"] == HALF and node_types(fp16.model)["mmr"] == HALF
    assert node_types(bf16.model)["fbn"] == FLOAT and node_types(bf16.model)["mmr"] == BF16
    assert ("fbn", "deploykit::FusedBatchNorm has no bf16 kernel") in {(n.node, n.reason) for n in bf16.fp32_nodes()}
    x = np.random.default_rng(2).standard_normal((2, 4, 3, 3)).astype(np.float32)
    reference = run(model, x)
    for result in (fp16, bf16):  # the functions are type-generic: ONNX Runtime runs them in any type
        np.testing.assert_allclose(run(emulate(result.model), x), reference, atol=0.05, rtol=0.05)


def fused_batch_norm_proto() -> onnx.FunctionProto:
    return ir.serde.serialize_function(fused_batch_norm.function("relu", 18))


def matmul_relu_proto() -> onnx.FunctionProto:
    return ir.serde.serialize_function(matmul_relu.function(18))


def test_bf16_moves_to_opset_22_and_keeps_our_functions():
    """Conv and AveragePool accept bfloat16 from opset 22 (not 18), so bf16 graphs move there."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("AveragePool", ["c"], ["y"], name="pool", kernel_shape=[2, 2])]
    model = make_model(nodes, [weight("w", (4, 3, 3, 3))], {"x": ["N", 3, 8, 8]}, {"y": 4})
    fp16, bf16 = apply_precision(model, "fp16"), apply_precision(model, "bf16")
    assert {o.domain: o.version for o in fp16.model.opset_import}[""] == 18
    assert {o.domain: o.version for o in bf16.model.opset_import}[""] == 22
    assert node_types(bf16.model)["conv"] == node_types(bf16.model)["pool"] == BF16
    onnx.checker.check_model(bf16.model, full_check=True)


def test_unnamed_nodes_get_names_and_derived_values_map_back():
    model = attention_like()
    for node in model.graph.node:
        node.name = ""
    named = name_nodes(model)
    assert len({n.name for n in named.graph.node}) == len(named.graph.node) and all(n.name for n in named.graph.node)
    assert not any(n.name for n in model.graph.node), "name_nodes must not modify its argument"
    assert source_name("h__fp32") == "h" and source_name("w1__bf16") == "w1" and source_name("h") == "h"


def test_bad_precision_is_refused():
    with pytest.raises(BadInputError, match="use fp32, fp16 or bf16"):
        apply_precision(attention_like(), "fp8")
    with pytest.raises(BadInputError, match="add --precision fp16 or bf16"):
        check_precision("fp32", None, auto_fix=True)


# --- the CPU emulation -------------------------------------------------------------------------


def overflow_chain() -> onnx.ModelProto:
    """y = (x * x) / x: in real fp16 x*x overflows for |x| > 256 and y is Inf."""
    nodes = [helper.make_node("Mul", ["x", "x"], ["square"], name="square"),
             helper.make_node("Div", ["square", "x"], ["y"], name="divide")]
    return make_model(nodes, [], {"x": ["N"]}, {"y": 1})


def test_emulation_rounds_every_node_output_like_fp16_kernels():
    """Node by node: compute in fp32, round to fp16 -- numpy's float16 gives the same."""
    typed = apply_precision(overflow_chain(), "fp16", io_precision="fp16").model
    x = np.array([300.0, 1.001, 3.3, 1e-4, -200.0], np.float32)
    x16 = x.astype(np.float16).astype(np.float32)
    with np.errstate(over="ignore"):
        square = (x16 * x16).astype(np.float16).astype(np.float32)
        expected = (square / x16).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(run(emulate(typed), x), expected)
    assert np.isinf(expected[0]) and expected[3] == 0.0  # overflow and underflow, as on a GPU


def test_onnx_runtime_cpu_understates_fp16_error_which_is_why_we_emulate():
    """ORT's CPU provider computes fp16 Mul and Div in fp32 and drops the rounding between
    them, so 300*300/300 comes out finite; the emulation shows the Inf fp16 kernels give."""
    typed = apply_precision(overflow_chain(), "fp16", io_precision="fp16").model
    x = np.array([300.0], np.float32)
    assert {"Div", "Mul"} <= set(ort_cpu_missing_kernels(typed, "fp16"))
    direct, note = typed_runner(typed, "fp16", None)
    assert np.isfinite(direct.run({"x": x})["y"]).all()
    assert "understates fp16 error" in note and "Mul" in note
    assert np.isinf(run(emulate(typed), x)).all()


def test_bf16_graphs_are_not_executed_by_onnx_runtime_cpu_and_say_so():
    typed = apply_precision(attention_like(), "bf16").model
    runner, note = typed_runner(typed, "bf16", None)
    assert runner is None
    assert note.startswith("not executed on the CPU") and "MatMul" in note


def test_float_io_feeds_and_reads_bf16_graphs_exactly():
    typed = apply_precision(attention_like(), "fp16", io_precision="bf16").model
    view = float_io(typed)
    assert [i.type.tensor_type.elem_type for i in view.graph.input] == [FLOAT]
    x = np.random.default_rng(3).standard_normal((2, 8, 16)).astype(np.float32)
    rounded = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(run(emulate(typed), x), run(emulate(float_io(typed)), rounded))


# --- whole models through the CLI ---------------------------------------------------------------

#: Per-output tolerances scaled to the outputs, as docs/precision.md explains: bf16 resnet18
#: (logits up to ~31) and fp16 sum pooling (logits up to ~41).
RESNET18_BF16 = "output:atol=0.3,rtol=0.05"
SUM_POOLING_FP16 = "output:atol=0.05"


def precision_report(tmp_path, *args: str) -> dict:
    result = convert(tmp_path, *args, "-o", "bundle")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "bundle" / "report.json").read_text())
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert report["verdict"] == "pass" and manifest["validation"]["passed"]
    assert manifest["precision"] == report["precision"]["precision"]
    assert manifest["reference_model"] == "model.fp32.onnx" and "model.fp32.onnx" in manifest["files"]
    return report


def check_outputs(report: dict, precision: str) -> None:
    """Cosine >= 0.999 and full top-1 agreement on every validated batch, plus the abs/rel check."""
    final = report["validation"]["candidates"][0]
    assert final["label"] == f"deploykit graph {precision}, rounding emulated per node"
    for run_ in final["runs"]:
        for output in run_["outputs"]:
            assert output["passed"], output["failures"]
            assert output["metrics"]["cosine"] >= 0.999 and output["metrics"]["top1_agreement"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_resnet18_passes_reduced_precision(tmp_path, precision):
    save_ddp_state_dict("resnet18", tmp_path / "weights.pt")
    tolerance = ["--tolerance", RESNET18_BF16] if precision == "bf16" else []
    report = precision_report(tmp_path, "weights.pt", "--factory", "model_zoo:resnet18", "--input", "x:1x3x67x53",
                              "--batch", "1:2:3", "--precision", precision, *tolerance)
    check_outputs(report, precision)
    info = report["precision"]
    assert info["nodes"][precision] == 49 and info["nodes"]["fp32"] == 0 and info["casts"] == 2
    model = onnx.load(tmp_path / "bundle" / "model.onnx")
    low = HALF if precision == "fp16" else BF16
    conv_weights = [i for i in model.graph.initializer if i.dims and len(i.dims) == 4]
    assert len(conv_weights) == 20 and {i.data_type for i in conv_weights} == {low}
    labels = [c["label"] for c in report["validation"]["candidates"]]
    if precision == "fp16":  # ORT's CPU provider runs fp16 graphs (upcasting most nodes) ...
        assert labels[1] == "deploykit graph fp16, onnxruntime-cpu kernels"
        assert "no fp16 CPU kernel for" in info["execution"] and "Conv" in info["execution"]
    else:  # ... but has no bf16 Conv
        assert len(labels) == 2 and info["execution"].startswith("not executed on the CPU")


@pytest.mark.parametrize("precision", ["fp16", pytest.param("bf16", marks=pytest.mark.slow)])
def test_small_transformer_passes_reduced_precision(tmp_path, precision):
    torch.manual_seed(0)
    torch.save(model_zoo.small_transformer().state_dict(), tmp_path / "weights.pt")
    report = precision_report(tmp_path, "weights.pt", "--factory", "model_zoo:small_transformer",
                              "--input", "x:1x16x12", "--batch", "1:2:3", "--precision", precision)
    check_outputs(report, precision)
    fp32 = collections.Counter((n["op"], n["reason"]) for n in report["precision"]["fp32_nodes"])
    # ONNX Runtime's layer norms (fused with the residual Add or not) accumulate in fp32: none is pinned
    assert fp32[("Softmax", "softmax")] == 2 and not [op for op, _ in fp32 if "Normalization" in op]
    assert report["ort_fusions"]["ops"]["com.microsoft::SkipLayerNormalization"] == 4
    heavy = [n for n in report["precision"]["fp32_nodes"] if n["op"] in ("MatMul", "Gemm")]
    assert not heavy, "matrix products must run in the reduced type"
    assert report["precision"]["tradeoff"]["fp32_share_of_multiply_adds"] < 0.05
    assert_casts_only_at_boundaries(onnx.load(tmp_path / "bundle" / "model.onnx"))


# --- TensorRT-RTX builds the typed graph ---------------------------------------------------------


@pytest.mark.parametrize("precision, trt_type", [("fp16", "HALF"), ("bf16", "BF16")])
def test_tensorrt_rtx_builds_a_strongly_typed_engine_with_our_types(precision, trt_type):
    dk_trt = pytest.importorskip("deploykit.backends.tensorrt.builder")
    shim = pytest.importorskip("deploykit.backends.tensorrt.shim")
    try:
        flavour = shim.load_tensorrt("tensorrt-rtx")
    except Exception as problem:  # noqa: BLE001
        pytest.skip(f"TensorRT-RTX is not importable ({problem})")
    typed = apply_precision(attention_like(), precision, target="tensorrt").model
    trt = flavour.module
    builder = trt.Builder(shim.logger(flavour))
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, shim.logger(flavour))
    assert parser.parse(typed.SerializeToString())
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    types = collections.Counter((layer.type.name, layer.get_output(0).dtype.name) for layer in layers)
    assert types[("MATRIX_MULTIPLY", trt_type)] == 3 and types[("MATRIX_MULTIPLY", "FLOAT")] == 0
    assert types[("SOFTMAX", "FLOAT")] == 1 and types[("NORMALIZATION", "FLOAT")] == 1
    build = dk_trt.build_engine(typed.SerializeToString(), batch=(1, 2, 4), targets=["8.6"], flavour="tensorrt-rtx")
    assert build.engine and build.targets == ("8.6",)


def test_convert_builds_a_typed_engine_with_our_fp16_plugin(tmp_path):
    """--backend tensorrt on the typed graph: our MatMulRelu plugin in fp16, the engine named fp16."""
    shim = pytest.importorskip("deploykit.backends.tensorrt.shim")
    try:
        shim.load_tensorrt("tensorrt-rtx")
    except Exception as problem:  # noqa: BLE001
        pytest.skip(f"TensorRT-RTX is not importable ({problem})")
    torch.manual_seed(0)
    torch.save(model_zoo.sum_pooling().state_dict(), tmp_path / "weights.pt")
    report = precision_report(tmp_path, "weights.pt", "--factory", "model_zoo:sum_pooling", "--input", "x:1x256x32",
                              "--batch", "1:2:4", "--precision", "fp16", "--backend", "tensorrt", "--trt-targets", "8.6",
                              "--tolerance", SUM_POOLING_FP16)
    (engine,) = report["engines"]
    assert engine["file"] == "model.fp16.sm86.engine"
    assert [layer["plugin"] for layer in engine["plugin_layer_list"]] == ["MatMulRelu"]
    assert not engine["validated"] and "engine built but not executed" in engine["note"]
    assert (tmp_path / "bundle" / engine["file"]).stat().st_size > 0
