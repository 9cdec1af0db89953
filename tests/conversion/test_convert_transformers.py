"""Transformers through ``deploykit convert``: ONNX Runtime's fusions in the bundle's graph, validated,
switched off by --no-ort-fusions, the fp16 plan they allow, and a TensorRT engine built without them.

A small torchvision ViT (attention not fused: its 3-D batched attention matches none of onnxscript's
patterns) and a small transformers BertModel (attention fused) with a dynamic batch.
"""

import collections
import json

import numpy as np
import onnx
import pytest
import torch

import deploykit
import model_zoo
from deploykit.specs import InputSpec
from deploykit.validation.inputs import random_feeds
from deploykit_cli import convert

pytest.importorskip("transformers")

CASES = {  # factory -> (inputs, ONNX Runtime ops the fused graph must have)
    "vit_tiny": (["x:2x3x32x32"], {"com.microsoft::SkipLayerNormalization": 4, "com.microsoft::BiasGelu": 2}),
    "bert_tiny": (["input_ids:2x16:int64", "attention_mask:2x16:int64"],
                  {"com.microsoft::Attention": 2, "com.microsoft::SkipLayerNormalization": 4,
                   "com.microsoft::BiasGelu": 2}),
}


def converted(tmp_path, name: str, *flags: str) -> tuple[dict, onnx.ModelProto]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.save(getattr(model_zoo, name)().state_dict(), tmp_path / "weights.pt")
    inputs = [arg for spec in CASES[name][0] for arg in ("--input", spec)]
    result = convert(tmp_path, "weights.pt", "--factory", f"model_zoo:{name}", *inputs, "--batch", "1:2:4",
                     "-o", "bundle", *flags)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "bundle" / "report.json").read_text())
    assert report["verdict"] == "pass", report["failures"]
    return report, onnx.load(tmp_path / "bundle" / "model.onnx")


def contrib_ops(model: onnx.ModelProto) -> dict[str, int]:
    ops = (f"{n.domain}::{n.op_type}" for n in model.graph.node if n.domain == "com.microsoft")
    return dict(collections.Counter(ops))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_ops_are_counted_and_validated(tmp_path, name, precision):
    report, model = converted(tmp_path, name, "--precision", precision)
    expected = CASES[name][1]
    assert report["ort_fusions"]["ops"] == expected == contrib_ops(model)
    (fusions,) = [p for p in report["passes"] if p["name"] == "ort_fusions"]
    assert fusions["changes"]["skip_layer_normalization"] == 4 and fusions["nodes_after"] < fusions["nodes_before"]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param, "batch must stay dynamic"
    labels = [c["label"] for c in report["validation"]["candidates"]]
    assert len(report["validation"]["batch_sizes"]) == 3
    assert all(c["passed"] for c in report["validation"]["candidates"])
    if precision == "fp16":
        assert labels[:2] == ["deploykit graph fp16, rounding emulated per node",
                              "deploykit graph fp16, onnxruntime-cpu kernels"]
        pinned = {n["op"] for n in report["precision"]["fp32_nodes"]}
        assert not pinned & {"LayerNormalization", "SkipLayerNormalization"}, "fused norms accumulate in fp32"
        assert "Attention" not in pinned, "the additive mask is clipped to fp16's range, not kept in fp32"
        # the fp16 bundle also loads and runs on the CPU provider (ONNX Runtime 1.32 crashed there on
        # fp16 ViT graphs until its NCHWc rewrite was left out)
        runner = deploykit.load(tmp_path / "bundle", device="cpu")
        feeds = random_feeds([InputSpec.parse(spec) for spec in CASES[name][0]], seed=5)
        assert np.isfinite(runner.run(feeds)["output"]).all()
        no_fusions_writes_plain_onnx_with_more_casts(tmp_path / "plain", name, report)


def no_fusions_writes_plain_onnx_with_more_casts(tmp_path, name: str, fused: dict) -> None:
    """--no-ort-fusions: no contrib op, no ort_fusions pass, and at least as many casts and more nodes
    in the fp16 graph than with the fusions (``fused``: that conversion's report)."""
    plain, model = converted(tmp_path, name, "--precision", "fp16", "--no-ort-fusions")
    assert plain["ort_fusions"] == {"enabled": False, "ops": {}, "engine_graph": None} and not contrib_ops(model)
    assert "ort_fusions" not in [p["name"] for p in plain["passes"]]
    assert fused["precision"]["casts"] <= plain["precision"]["casts"]
    assert sum(fused["precision"]["nodes"].values()) < sum(plain["precision"]["nodes"].values())


@pytest.mark.slow
@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=pytest.mark.slow), "fp16"])
def test_tensorrt_engine_is_built_from_the_graph_without_contrib_ops(tmp_path, precision):
    shim = pytest.importorskip("deploykit.backends.tensorrt.shim")
    try:
        shim.load_tensorrt()
    except Exception as problem:  # noqa: BLE001  (any import failure means: no TensorRT here)
        pytest.skip(f"no TensorRT or TensorRT-RTX: {problem}")
    report, model = converted(tmp_path, "bert_tiny", "--precision", precision, "--backend", "all",
                              "--trt-targets", "8.6")
    assert contrib_ops(model) == CASES["bert_tiny"][1], "ONNX Runtime's graph keeps its fused ops"
    (engine,) = report["engines"]
    assert report["ort_fusions"]["engine_graph"] == "the same passes without ort_fusions" and engine["layers"] > 0
    labels = [c["label"] for c in report["validation"]["candidates"]]
    graph_label = "tensorrt engine's graph" + ("" if precision == "fp32" else " fp16, rounding emulated per node")
    if engine["validated"]:
        assert labels[0] == "tensorrt engine"
    else:  # the engine cannot run here: the graph it was built from is validated in its place
        assert graph_label in labels
