"""ONNX Runtime's fused transformer ops in fp16 bundles run on its CUDA provider and match PyTorch.

On the CPU, convert validates fp16 bundles with the per-node rounding emulation, and ONNX Runtime's
CPU provider has no fp16 Attention or BiasGelu kernel (docs/passes.md). Here the typed graph runs as
deployed: every fused node must run on the CUDA provider with fp16 inputs, and the outputs must
pass the fp16 tolerances against PyTorch fp32.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

pytestmark = pytest.mark.gpu
CUDA = "CUDAExecutionProvider"
if CUDA not in ort.get_available_providers():
    pytest.skip(f"onnxruntime {ort.__version__} has no {CUDA} (install onnxruntime-gpu)", allow_module_level=True)
pytest.importorskip("transformers")

import model_zoo  # noqa: E402
import op_library_cases as ort_cases  # noqa: E402  (session and profile helpers)

from deploykit.api import ConvertOptions, convert  # noqa: E402
from deploykit.specs import BatchRange, InputSpec  # noqa: E402
from deploykit.validation.compare import Tolerance, compare_output  # noqa: E402
from deploykit.validation.inputs import random_feeds  # noqa: E402

MODELS = {  # factory -> (inputs, fused ops that must run on CUDA)
    "vit_tiny": (["x:2x3x32x32"], {"SkipLayerNormalization", "BiasGelu"}),
    "bert_tiny": (["input_ids:2x16:int64", "attention_mask:2x16:int64"],
                  {"Attention", "SkipLayerNormalization", "BiasGelu"}),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_fp16_fused_ops_run_on_cuda_and_match_pytorch(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)  # ORT writes its profile into the working directory
    specs, fused = MODELS[name]
    torch.manual_seed(0)
    model = getattr(model_zoo, name)().eval()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    result = convert(ConvertOptions(
        model=tmp_path / "weights.pt", output=tmp_path / "bundle", factory=f"model_zoo:{name}",
        inputs=[InputSpec.parse(s) for s in specs], batch=BatchRange(1, 2, 8), precision="fp16",
    ))
    assert result.passed, result.report["failures"]
    graph = onnx.load(tmp_path / "bundle" / "model.onnx")
    session = ort_cases.session(graph.SerializeToString(), None, [(CUDA, {"use_tf32": "0"})], profile=True)
    feeds = random_feeds([InputSpec.parse(s).with_batch(8) for s in specs], seed=11)
    (actual,) = session.run(None, feeds)
    with torch.inference_mode():
        expected = model(*(torch.from_numpy(feeds[InputSpec.parse(s).name]) for s in specs)).numpy()
    # abs/rel and cosine bounds only: the tiny ViT's random-weight logits come in near-ties, and
    # one of 8 rows flipping its arg-max at 0.004 abs error (seen on the H200) says nothing of fp16
    tolerance = dataclasses.replace(Tolerance.for_precision("fp16"), min_top1=None)
    comparison = compare_output("output", expected, actual.astype(np.float32), tolerance)
    assert comparison.passed, comparison.failures
    ran = [node for node in ort_cases.profiled_nodes(session) if node["op"] in fused]
    assert {node["op"] for node in ran} == fused
    assert all(node["provider"] == CUDA and node["types"][0] == "float16" for node in ran), ran
    print(f"{name}: fp16 max abs {comparison.metrics['max_abs']:.3g}; {len(ran)} fused nodes on CUDA")
