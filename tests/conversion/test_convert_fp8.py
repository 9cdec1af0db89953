"""``deploykit convert --precision fp8 --backend aoti``: the Linear layers' products in float8 e4m3
(``torch._scaled_mm``) inside AOTInductor packages, the rest fp16. On the CPU torch computes fp8
products exactly as the GPU rounds them, so the conversion, its validation and its report are tested
here; the speed is measured on the GPU (tests/gpu/test_fp8_gpu.py, BENCHMARKS.md).
"""

import json

import numpy as np
import pytest
import torch

import model_zoo
from deploykit.conversion import fp8
from deploykit.conversion.options import ConvertOptions
from deploykit.conversion.pipeline import convert as convert_api
from deploykit.conversion.quantize import Calibration
from deploykit.errors import BadInputError
from deploykit_cli import assert_rejected, convert

TOKENS = "tokens:2x8x32"


def _calibration(batches: list[torch.Tensor], source: str = "calibration.npz") -> Calibration:
    return Calibration([{"x": batch.numpy()} for batch in batches], source, sum(len(b) for b in batches))


def test_fp8_linear_rounds_like_e4m3():
    """Within e4m3's rounding of the Linear's (3 mantissa bits), on (batch, tokens, features) inputs."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(3, 5, 64)
    quantized = fp8.Fp8Linear(linear, input_amax=float(x.abs().max()))
    with torch.no_grad():
        expected, got = linear(x), quantized(x)
    assert got.shape == expected.shape == (3, 5, 48)
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0)
    assert 0.995 < cosine < 1.0  # close, and not the float product
    assert quantized.weight.dtype == torch.float8_e4m3fn and quantized.weight.shape == (48, 64)
    assert float(quantized.input_scale) == pytest.approx(float(x.abs().max()) / 448)


def test_stage_quantizes_the_aligned_linears_and_says_why_the_others_stay_float():
    torch.manual_seed(0)
    model = model_zoo.small_transformer().eval()
    batches = [torch.randn(4, 16, 12) for _ in range(2)]
    stage = fp8.Fp8Stage.start(model, _calibration(batches))
    assert list(stage.input_amax) == [f"blocks.{i}.{layer}" for i in (0, 1) for layer in
                                      ("attention.in_proj", "attention.out_proj", "mlp.0", "mlp.2")]
    assert set(stage.float_layers) == {"embed", "head"}
    assert "multiples of 16" in stage.float_layers["embed"] and "multiples of 16" in stage.float_layers["head"]
    block = model.blocks[0]
    with torch.no_grad():  # the calibrated range is the largest input the layer saw: norm2 of the residual
        residuals = [x + block.attention(*[block.norm1(x)] * 3, need_weights=False)[0]
                     for x in (model.embed(b) + model.position for b in batches)]
        seen = max(float(block.norm2(r).abs().max()) for r in residuals)
    assert stage.input_amax["blocks.0.mlp.0"] == pytest.approx(seen, rel=1e-5)
    quantized = stage.apply(model_zoo.small_transformer().eval())
    assert isinstance(quantized.blocks[1].mlp[2], fp8.Fp8Linear) and isinstance(quantized.head, torch.nn.Linear)
    assert isinstance(quantized.blocks[0].attention.in_proj, fp8.Fp8Linear)
    report = stage.to_json()
    assert report["nodes"] == {"fp8": 8, "float": 2} and "note" not in report["calibration"]


@pytest.mark.parametrize("batch_first", [True, False])
def test_restructured_attention_computes_what_multihead_attention_does(batch_first):
    """Through its two Linear layers for plain self-attention; as nn.MultiheadAttention for the other calls."""
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(32, 4, batch_first=batch_first).eval()
    restructured = fp8.SelfAttention(attention).eval()
    x, other = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    mask = torch.rand(x.shape[1 if batch_first else 0], x.shape[1 if batch_first else 0]) > 0.3
    mask.fill_diagonal_(False)  # no row fully masked
    with torch.no_grad():
        for args, kwargs in [((x, x, x), {"need_weights": False}), ((x, x, x), {}), ((x, other, other), {}),
                             ((x, x, x), {"attn_mask": mask, "need_weights": False})]:
            expected, got = attention(*args, **kwargs), restructured(*args, **kwargs)
            torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
            assert (got[1] is None) == (expected[1] is None)


class MaskedAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.mlp = torch.nn.Linear(32, 32)

    def forward(self, x):
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        return self.mlp(self.attention(x, x, x, attn_mask=mask, need_weights=False)[0])


def test_attention_called_with_a_mask_stays_float():
    torch.manual_seed(0)
    stage = fp8.Fp8Stage.start(MaskedAttention().eval(), _calibration([torch.randn(2, 6, 32)]))
    assert list(stage.input_amax) == ["mlp"]
    assert stage.float_layers["attention.in_proj"] == stage.float_layers["attention.out_proj"] == fp8.NOT_CALLED


def test_random_calibration_makes_every_output_inconclusive():
    torch.manual_seed(0)
    stage = fp8.Fp8Stage.start(model_zoo.small_transformer().eval(), _calibration([torch.randn(2, 16, 12)], "random"))
    assert stage.inconclusive_reasons(["logits"]) == {"logits": fp8.RANDOM_DATA_NOTE}
    assert stage.to_json()["calibration"]["note"] == fp8.RANDOM_DATA_NOTE


def test_no_linear_to_quantize_is_bad_input():
    with pytest.raises(BadInputError, match="found no nn.Linear layer to quantize.*--precision fp16"):
        fp8.Fp8Stage.start(model_zoo.tiny_conv().eval(), _calibration([torch.randn(2, 3, 8, 8)]))


@pytest.mark.parametrize("changes, words", [
    ({"backend": "onnxruntime"}, "--backend onnxruntime is not supported with --precision fp8"),
    ({"io_precision": "fp16"}, "--io-precision is not supported with --precision fp8"),
    ({"calibration_method": "entropy"}, "--calibration-method entropy applies to int8"),
])
def test_fp8_refuses_what_it_does_not_do(tmp_path, changes, words):
    options = ConvertOptions(tmp_path / "missing.pt2", tmp_path / "bundle", precision="fp8",
                             **{"backend": "aoti", **changes})
    with pytest.raises(BadInputError, match=words):
        convert_api(options)
    assert not (tmp_path / "bundle").exists()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A transformer MLP (two blocks, width 32) converted to fp8 with 64 calibration samples: (folder, result)."""
    folder = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    torch.save(model_zoo.transformer_mlp_32().state_dict(), folder / "weights.pt")
    np.savez(folder / "calibration.npz", tokens=np.random.default_rng(5).standard_normal((64, 8, 32), dtype=np.float32))
    result = convert(folder, "weights.pt", "--factory", "model_zoo:transformer_mlp_32", "--input", TOKENS,
                     "--precision", "fp8", "--backend", "aoti", "--calibration", "calibration.npz", "-o", "bundle")
    return folder, result


def test_fp8_package_passes_and_the_bundle_says_what_is_fp8(calibrated):
    folder, result = calibrated
    assert result.returncode == 0, result.stderr
    assert "Precision: fp8 (4 nodes fp8, 1 float" in result.stderr and "Precision: fp16" in result.stderr
    report = json.loads((folder / "bundle" / "report.json").read_text())
    manifest = json.loads((folder / "bundle" / "manifest.json").read_text())
    assert report["verdict"] == "pass" and manifest["precision"] == "fp8"
    assert [entry["precision"] for entry in manifest["aoti"]] == ["fp8"] and manifest["aoti"][0]["validated"]
    assert manifest["quantization"]["quantized_nodes"] == ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]
    assert manifest["quantization"]["float_nodes"][0]["node"] == "head"
    package = next(c for c in report["validation"]["candidates"] if c["label"].startswith("aoti"))
    cosine = package["runs"][0]["outputs"][0]["metrics"]["cosine"]
    assert package["passed"] and 0.99 < cosine < 0.99999  # fp8's rounding: within bounds, and visible
    assert "Precision: fp8" in (folder / "bundle" / "report.html").read_text()


@pytest.mark.slow
def test_fp8_without_calibration_is_inconclusive(calibrated):
    folder, _ = calibrated
    result = convert(folder, "weights.pt", "--factory", "model_zoo:transformer_mlp_32", "--input", TOKENS,
                     "--precision", "fp8", "--backend", "aoti", "-o", "random")
    assert result.returncode == 5, result.stderr
    assert "the fp8 scales were fitted to random inputs" in result.stderr


def test_fp8_needs_a_module_not_an_exported_program(tmp_path):
    torch.manual_seed(0)
    program = torch.export.export(model_zoo.transformer_mlp_32().eval(), (torch.randn(2, 8, 32),))
    torch.export.save(program, tmp_path / "model.pt2")
    result = convert(tmp_path, "model.pt2", "--precision", "fp8", "--backend", "aoti", "-o", "bundle")
    assert_rejected(result, "--precision fp8 needs the model as an nn.Module", "--factory")
    assert not (tmp_path / "bundle").exists()


def test_fp8_cli_needs_aoti(tmp_path):
    result = convert(tmp_path, "weights.pt", "--input", TOKENS, "--precision", "fp8", "-o", "bundle")
    assert_rejected(result, "--backend onnxruntime is not supported with --precision fp8", "add --backend aoti")


@pytest.mark.slow
def test_auto_fix_keeps_the_layer_fp8_breaks_in_fp16(tmp_path):
    """fp8_outlier's head reads an input whose one e4m3 scale flushes all but one feature: the package fails
    (exit 1) without --auto-fix; with it, the head ranks first, is kept in fp16 in round 1, and the
    packages compiled again pass, the other two layers still fp8; the console and report say so."""
    torch.manual_seed(0)
    torch.save(model_zoo.fp8_outlier().state_dict(), tmp_path / "weights.pt")
    np.savez(tmp_path / "calibration.npz", x=np.random.default_rng(5).standard_normal((64, 16), dtype=np.float32))
    args = ["weights.pt", "--factory", "model_zoo:fp8_outlier", "--input", "x:1x16", "--batch", "1:4:8",
            "--precision", "fp8", "--backend", "aoti", "--aoti-shapes", "dynamic", "--calibration", "calibration.npz"]
    plain = convert(tmp_path, *args, "-o", "plain")
    assert plain.returncode == 1 and "aoti cpu dynamic package (aoti-cpu): FAIL" in plain.stdout + plain.stderr
    fixed = convert(tmp_path, *args, "--auto-fix", "-o", "fixed")
    assert fixed.returncode == 0, fixed.stderr
    assert "auto-fix round 1: 1 node in float, pass" in fixed.stderr
    precision = json.loads((tmp_path / "fixed" / "report.json").read_text())["precision"]
    assert precision["quantized_nodes"] == ["first", "hidden"]
    assert precision["float_nodes"] == [{"node": "head", "op": "Linear", "precision": "fp16",
                                         "reason": fp8.AUTO_FIX_REASON}]
    fix = precision["auto_fix"]
    assert fix["method"] == fp8.AUTO_FIX_METHOD and fix["kept_float"][0]["node"] == "head"
    assert fix["rounds"][0]["passed"] and fix["quantized_ms"] > 0
