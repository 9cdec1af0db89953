"""BatchNormalization folding (deploykit.passes.fold_bn) is exact where it applies.

Each test builds a small ONNX graph with randomised BN statistics, runs ONNX Runtime on
it before and after ``run_passes``, and checks that the outputs agree, that the expected
rule fired the expected number of times, and that no BatchNormalization is left — or, for
the cases folding would make inexact or cannot handle, that the BN is kept and the
results are unchanged.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from deploykit.passes import run_passes
from onnx_graphs import batch_norm, make_model, output, run_ort, tensor

BATCH = 3


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def fold_and_compare(model: onnx.ModelProto, feeds: dict[str, np.ndarray]):
    """Fold ``model``, assert ORT gives the same outputs; return (folded model, fold_batch_norm changes)."""
    expected = run_ort(model, feeds)
    folded, stats = run_passes(model, custom_ops=False)
    onnx.checker.check_model(folded)
    actual = run_ort(folded, feeds)
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want).max()))
    (fold,) = [s for s in stats if s.name == "fold_batch_norm"]
    return folded, fold.changes


def op_types(model: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in model.graph.node]


def assert_folded(model: onnx.ModelProto, changes: dict[str, int], expected: dict[str, int]) -> None:
    assert changes == expected
    assert "BatchNormalization" not in op_types(model)


def assert_not_folded(model: onnx.ModelProto, changes: dict[str, int]) -> None:
    assert sum(changes.values()) == 0, changes
    assert op_types(model).count("BatchNormalization") == 1


def conv_bn_model(rng, *, dims=2, bias=True, group=1):
    """x -> Conv(k=3, pad=1) -> BN -> y, 6 -> 6 channels; returns the model and a random input."""
    c_in = c_out = 6
    spatial = [7, 5][:dims]
    weight = tensor("w", rng.normal(size=(c_out, c_in // group, *[3] * dims)))
    inits = [weight] + ([tensor("b", rng.normal(size=c_out))] if bias else [])
    conv = helper.make_node(
        "Conv", ["x", "w"] + (["b"] if bias else []), ["conv_out"], group=group, pads=[1] * 2 * dims
    )
    bn, bn_inits = batch_norm(rng, "conv_out", "y", c_out)
    model = make_model([conv, bn], inits + bn_inits, {"x": ["N", c_in, *spatial]}, {"y": dims + 2})
    return model, {"x": rng.normal(size=(BATCH, c_in, *spatial)).astype(np.float32)}


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_conv_bn(rng, dims, group, bias):
    model, feeds = conv_bn_model(rng, dims=dims, bias=bias, group=group)
    folded, changes = fold_and_compare(model, feeds)
    assert_folded(folded, changes, {"fold_bn_into_conv" + "_bias" * bias: 1})


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_conv_transpose_bn(rng, group, bias):
    c_in, c_out = 4, 6
    inits = [tensor("w", rng.normal(size=(c_in, c_out // group, 3, 3)))]
    inits += [tensor("b", rng.normal(size=c_out))] if bias else []
    conv = helper.make_node(
        "ConvTranspose", ["x", "w"] + (["b"] if bias else []), ["conv_out"],
        group=group, strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1],
    )
    bn, bn_inits = batch_norm(rng, "conv_out", "y", c_out)
    model = make_model([conv, bn], inits + bn_inits, {"x": ["N", c_in, 7, 5]}, {"y": 4})
    folded, changes = fold_and_compare(model, {"x": rng.normal(size=(BATCH, c_in, 7, 5)).astype(np.float32)})
    assert_folded(folded, changes, {"fold_bn_into_convtranspose" + "_bias" * bias: 1})


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_bn(rng, trans_b, bias):
    k, n = 5, 6
    inits = [tensor("w", rng.normal(size=(n, k) if trans_b else (k, n)))]
    inits += [tensor("c", rng.normal(size=n))] if bias else []
    gemm = helper.make_node(
        "Gemm", ["x", "w"] + (["c"] if bias else []), ["gemm_out"], transB=trans_b, alpha=0.7, beta=1.3
    )
    bn, bn_inits = batch_norm(rng, "gemm_out", "y", n)
    model = make_model([gemm, bn], inits + bn_inits, {"x": ["N", k]}, {"y": 2})
    folded, changes = fold_and_compare(model, {"x": rng.normal(size=(BATCH, k)).astype(np.float32)})
    assert_folded(folded, changes, {"fold_bn_into_gemm" + "_bias" * bias: 1})


@pytest.mark.parametrize("add", [None, "bias_second", "bias_first"])
def test_matmul_bn(rng, add):
    k, n = 5, 6
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm_out"])]
    inits = [tensor("w", rng.normal(size=(k, n)))]
    if add:
        inits.append(tensor("b", rng.normal(size=n)))
        operands = ["mm_out", "b"] if add == "bias_second" else ["b", "mm_out"]
        nodes.append(helper.make_node("Add", operands, ["add_out"]))
    bn, bn_inits = batch_norm(rng, nodes[-1].output[0], "y", n)
    model = make_model(nodes + [bn], inits + bn_inits, {"x": ["N", k]}, {"y": 2})
    folded, changes = fold_and_compare(model, {"x": rng.normal(size=(BATCH, k)).astype(np.float32)})
    assert_folded(folded, changes, {"fold_bn_into_matmul" + "_add" * bool(add): 1})


def bn_conv_model(rng, *, kernel, bias, group=1, strides=1, pads=None):
    """x -> BN -> Conv -> y, 6 -> 9 channels; ``pads=None`` leaves the attribute out."""
    c_in, c_out = 6, 9
    bn, bn_inits = batch_norm(rng, "x", "bn_out", c_in)
    inits = [tensor("w", rng.normal(size=(c_out, c_in // group, kernel, kernel)))]
    inits += [tensor("b", rng.normal(size=c_out))] if bias else []
    attrs = {"group": group, "strides": [strides, strides]}
    if pads is not None:
        attrs["pads"] = [pads] * 4
    conv = helper.make_node("Conv", ["bn_out", "w"] + (["b"] if bias else []), ["y"], **attrs)
    model = make_model([bn, conv], bn_inits + inits, {"x": ["N", c_in, 7, 5]}, {"y": 4})
    return model, {"x": rng.normal(size=(BATCH, c_in, 7, 5)).astype(np.float32)}


@pytest.mark.parametrize(
    "conv", [dict(kernel=1), dict(kernel=3, pads=0, strides=2), dict(kernel=1, group=3)],
    ids=["1x1", "3x3_pad0_stride2", "1x1_group3"],
)
@pytest.mark.parametrize("bias", [False, True])
def test_bn_conv(rng, conv, bias):
    model, feeds = bn_conv_model(rng, bias=bias, **conv)
    folded, changes = fold_and_compare(model, feeds)
    assert_folded(folded, changes, {"fold_bn_into_next_conv" + "_bias" * bias: 1})


@pytest.mark.parametrize("bias", [False, True])
def test_bn_conv_with_padding_is_kept(rng, bias):
    model, feeds = bn_conv_model(rng, kernel=3, bias=bias, pads=1)
    assert_not_folded(*fold_and_compare(model, feeds))


def test_matmul_bn_on_3d_input_is_kept(rng):
    # (N, 6, 5) @ (5, 6): BN's axis 1 has the weight's width but is not the feature axis.
    k, n = 5, 6
    mm = helper.make_node("MatMul", ["x", "w"], ["mm_out"])
    bn, bn_inits = batch_norm(rng, "mm_out", "y", n)
    weight = tensor("w", rng.normal(size=(k, n)))
    model = make_model([mm, bn], [weight] + bn_inits, {"x": ["N", n, k]}, {"y": 3})
    assert_not_folded(*fold_and_compare(model, {"x": rng.normal(size=(BATCH, n, k)).astype(np.float32)}))


@pytest.mark.parametrize("other_use", ["graph_output", "relu_output"])
def test_conv_bn_with_shared_conv_output_is_kept(rng, other_use):
    model, feeds = conv_bn_model(rng)
    if other_use == "graph_output":
        model.graph.output.append(output("conv_out", 4))
    else:
        model.graph.node.append(helper.make_node("Relu", ["conv_out"], ["relu_out"]))
        model.graph.output.append(output("relu_out", 4))
    onnx.checker.check_model(model)
    assert_not_folded(*fold_and_compare(model, feeds))


@pytest.mark.parametrize("keep_initializer", [False, True], ids=["input", "input_with_default"])
def test_bn_with_mean_as_graph_input_is_kept(rng, keep_initializer):
    # With the initializer kept, it is only a default that the fed mean overrides.
    model, feeds = conv_bn_model(rng)
    if not keep_initializer:
        (mean,) = [t for t in model.graph.initializer if t.name == "bn.mean"]
        model.graph.initializer.remove(mean)
    model.graph.input.append(helper.make_tensor_value_info("bn.mean", TensorProto.FLOAT, [6]))
    feeds["bn.mean"] = rng.normal(size=6).astype(np.float32)
    assert_not_folded(*fold_and_compare(model, feeds))


def test_bn_conv_bn_chain(rng):
    c_in, c_out = 6, 9
    bn1, bn1_inits = batch_norm(rng, "x", "bn1_out", c_in, name="bn1")
    conv = helper.make_node("Conv", ["bn1_out", "w"], ["conv_out"])
    bn2, bn2_inits = batch_norm(rng, "conv_out", "y", c_out, name="bn2")
    inits = bn1_inits + [tensor("w", rng.normal(size=(c_out, c_in, 1, 1)))] + bn2_inits
    model = make_model([bn1, conv, bn2], inits, {"x": ["N", c_in, 7, 5]}, {"y": 4})
    folded, changes = fold_and_compare(model, {"x": rng.normal(size=(BATCH, c_in, 7, 5)).astype(np.float32)})
    assert sum(changes.values()) == 2, changes
    assert op_types(folded) == ["Conv"]
