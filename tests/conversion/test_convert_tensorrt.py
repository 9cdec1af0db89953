"""``convert --backend all`` builds a TensorRT-RTX engine on this GPU-less machine, with our
plugins replacing every deploykit node and the plugin library embedded in the engine.

No TensorRT runtime here can execute it (no GPU; and RTX refuses Hopper): the report must
say so plainly rather than claim a validation it did not do.
"""

import hashlib
import json

import pytest

from deploykit.native import build as native
from bundle_reports import custom_op_counts
from deploykit_cli import convert
from model_zoo import save_ddp_state_dict

tensorrt = pytest.importorskip("deploykit.backends.tensorrt.shim")
try:
    tensorrt.load_tensorrt()
except Exception as problem:  # noqa: BLE001  (any import failure means: no TensorRT here)
    pytest.skip(f"no TensorRT or TensorRT-RTX: {problem}", allow_module_level=True)

CASES = {  # factory -> (input spec, extra CLI flags)
    "densenet121": ("x:1x3x64x57", ()),
    "resnet18": ("x:1x3x67x53", ()),
    "transformer_mlp": ("tokens:1x9x40", ()),
    "densenet121-plain": ("x:1x3x64x57", ("--no-custom-ops",)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_engine_with_embedded_plugins(tmp_path, case):
    name = case.removesuffix("-plain")
    spec, flags = CASES[case]
    save_ddp_state_dict(name, tmp_path / "weights.pt")
    result = convert(
        tmp_path, "weights.pt", "--factory", f"model_zoo:{name}", "--input", spec, "--batch", "1:2:4",
        "--backend", "all", "--trt-targets", "8.6,12.0", "-o", "bundle", *flags,
    )
    assert result.returncode == 0, result.stderr
    bundle = tmp_path / "bundle"
    manifest = json.loads((bundle / "manifest.json").read_text())
    report = json.loads((bundle / "report.json").read_text())
    (engine,) = manifest["engines"]
    assert engine["file"] == "model.fp32.sm86_sm120.engine" and engine["file"] in manifest["files"]
    assert engine["flavour"] == "tensorrt-rtx" and engine["targets"] == ["8.6", "12.0"]
    assert not engine["validated"] and "engine built but not executed" in engine["note"]
    assert "not executed" in result.stderr and "not executed" in (bundle / "report.html").read_text()
    nodes = sum(custom_op_counts(report).values())
    assert engine["plugin_layers"] == nodes
    engine_bytes = (bundle / engine["file"]).read_bytes()
    if nodes:
        library = native.build_plugins().tensorrt_library.read_bytes()
        assert engine["plugin_library_sha256"] == hashlib.sha256(library).hexdigest()
        assert library in engine_bytes, "the plugin library must be serialized into the engine"
        assert {layer["plugin"] for layer in engine["plugin_layer_list"]} <= {"FusedBatchNorm", "MatMulRelu"}
    else:
        assert engine["plugin_library_sha256"] is None
