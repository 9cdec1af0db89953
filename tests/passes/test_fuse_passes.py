"""Fusion into deploykit ops keeps results, and the written file runs without our library.

Each graph is run in ONNX Runtime before and after ``run_passes``; the fused graph carries
ONNX local functions, so ORT (without deploykit's op library) executes them and must
reproduce the original outputs. The checker validates functions, overloads and opsets.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from deploykit.ops import DOMAIN, custom_op_types
from deploykit.passes import run_passes
from onnx_graphs import batch_norm, make_model, run_ort, tensor


@pytest.fixture
def rng():
    return np.random.default_rng(1)


def fuse_and_compare(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[onnx.ModelProto, dict]:
    """Run the default passes; check the file, and that ORT (functions only) matches the original."""
    expected = run_ort(model, feeds)
    fused, stats = run_passes(model)
    onnx.checker.check_model(fused, full_check=True)
    for got, want in zip(run_ort(fused, feeds), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(want).max()))
    changes = {rule: n for s in stats if s.name.startswith("fuse_") for rule, n in s.changes.items()}
    return fused, changes


def custom_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if node.domain == DOMAIN]


@pytest.mark.parametrize("rank", [2, 3, 4, 5])
def test_batch_norm_after_add_becomes_fused_relu(rng, rank):
    shape = [3, 6, 7, 5, 2][:rank]
    bn, params = batch_norm(rng, "sum", "normed", 6)
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]), bn, helper.make_node("Relu", ["normed"], ["y"])]
    model = make_model(nodes, params, {"a": ["N", *shape[1:]], "b": ["N", *shape[1:]]}, {"y": rank})
    feeds = {k: rng.normal(size=shape).astype(np.float32) for k in "ab"}
    fused, changes = fuse_and_compare(model, feeds)
    assert changes == {"fused_batch_norm_relu": 1}
    (node,) = custom_nodes(fused)
    assert (node.op_type, helper.get_attribute_value(node.attribute[0])) == ("FusedBatchNorm", b"relu")
    assert [f.name for f in fused.functions] == ["FusedBatchNorm"]
    assert {o.domain: o.version for o in fused.opset_import}[DOMAIN] == 1


def test_batch_norm_with_two_consumers_keeps_its_relu_apart(rng):
    """The BN output also leaves the graph, so the Relu cannot be absorbed: activation none."""
    bn, params = batch_norm(rng, "cat", "normed", 8)
    nodes = [helper.make_node("Concat", ["a", "b"], ["cat"], axis=1), bn, helper.make_node("Relu", ["normed"], ["y"])]
    model = make_model(nodes, params, {"a": ["N", 3, 5, 4], "b": ["N", 5, 5, 4]}, {"y": 4, "normed": 4})
    feeds = {"a": rng.normal(size=(2, 3, 5, 4)).astype(np.float32), "b": rng.normal(size=(2, 5, 5, 4)).astype(np.float32)}
    fused, changes = fuse_and_compare(model, feeds)
    assert changes == {"fused_batch_norm_none": 1}
    assert "Relu" in [n.op_type for n in fused.graph.node]


def test_a_model_gets_one_activation_so_one_function_body(rng):
    """TensorRT inlines functions by name alone: mixing activations would pick one body for both."""
    bn1, p1 = batch_norm(rng, "a", "n1", 4, name="bn1")
    bn2, p2 = batch_norm(rng, "r1", "y", 4, name="bn2")
    nodes = [bn1, helper.make_node("Relu", ["n1"], ["r1"]), bn2]
    model = make_model(nodes, p1 + p2, {"a": ["N", 4, 3]}, {"y": 3})
    fused, changes = fuse_and_compare(model, {"a": rng.normal(size=(2, 4, 3)).astype(np.float32)})
    assert changes == {"fused_batch_norm_relu": 1}
    assert [n.op_type for n in fused.graph.node] == ["FusedBatchNorm", "BatchNormalization"]
    assert [f.name for f in fused.functions] == ["FusedBatchNorm"]


def linear(rng, name: str, k: int, n: int):
    return tensor(f"{name}.w", rng.normal(size=(k, n)) / np.sqrt(k)), tensor(f"{name}.b", rng.normal(size=n))


@pytest.mark.parametrize("bias_shape", [None, (9,), (1, 9), (1, 1, 9)])
def test_matmul_add_relu_on_3d_input(rng, bias_shape):
    w = tensor("w", rng.normal(size=(5, 9)))
    nodes, inits, product = [helper.make_node("MatMul", ["a", "w"], ["p"])], [w], "p"
    if bias_shape:
        inits.append(tensor("b", rng.normal(size=bias_shape)))
        nodes.append(helper.make_node("Add", ["b", "p"], ["pb"]))  # bias first: the rule must commute
        product = "pb"
    nodes.append(helper.make_node("Relu", [product], ["y"]))
    model = make_model(nodes, inits, {"a": ["N", 4, 5]}, {"y": 3})
    fused, changes = fuse_and_compare(model, {"a": rng.normal(size=(3, 4, 5)).astype(np.float32)})
    assert changes == {"matmul_add_relu" if bias_shape else "matmul_relu": 1}
    (node,) = custom_nodes(fused)
    assert node.op_type == "MatMulRelu" and len(node.input) == 3


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("with_c", [True, False])
def test_gemm_relu_folds_alpha_beta_and_transpose(rng, trans_b, with_c):
    w = tensor("w", rng.normal(size=(9, 5) if trans_b else (5, 9)))
    inputs, inits = ["a", "w"], [w]
    if with_c:
        inputs.append("c")
        inits.append(tensor("c", rng.normal(size=9)))
    nodes = [helper.make_node("Gemm", inputs, ["g"], alpha=0.7, beta=1.3, transB=trans_b), helper.make_node("Relu", ["g"], ["y"])]
    model = make_model(nodes, inits, {"a": ["N", 5]}, {"y": 2})
    fused, changes = fuse_and_compare(model, {"a": rng.normal(size=(4, 5)).astype(np.float32)})
    assert changes == {"gemm_bias_relu" if with_c else "gemm_relu": 1}


def test_what_the_kernel_cannot_compute_is_left_alone(rng):
    """A per-row bias, a non-constant B, and a Relu on a MatMul output used twice stay as they are."""
    nodes = [
        helper.make_node("MatMul", ["a", "w"], ["p1"]),
        helper.make_node("Add", ["p1", "rowbias"], ["p1b"]),
        helper.make_node("Relu", ["p1b"], ["y1"]),
        helper.make_node("MatMul", ["a", "b_in"], ["p2"]),
        helper.make_node("Relu", ["p2"], ["y2"]),
        helper.make_node("MatMul", ["a", "w"], ["p3"]),
        helper.make_node("Relu", ["p3"], ["y3"]),
    ]
    inits = [tensor("w", rng.normal(size=(5, 6))), tensor("rowbias", rng.normal(size=(4, 1)))]
    model = make_model(nodes, inits, {"a": [4, 5], "b_in": [5, 6]}, {"y1": 2, "y2": 2, "y3": 2, "p3": 2})
    feeds = {"a": rng.normal(size=(4, 5)).astype(np.float32), "b_in": rng.normal(size=(5, 6)).astype(np.float32)}
    fused, changes = fuse_and_compare(model, feeds)
    assert changes == {} and not custom_op_types(fused)


def test_no_custom_ops_writes_standard_onnx(rng):
    bn, params = batch_norm(rng, "sum", "y", 6)
    model = make_model([helper.make_node("Add", ["a", "a"], ["sum"]), bn], params, {"a": ["N", 6, 3]}, {"y": 3})
    plain, _ = run_passes(model, custom_ops=False)
    assert not custom_op_types(plain) and not plain.functions
    assert [n.op_type for n in plain.graph.node] == ["Add", "BatchNormalization"]
