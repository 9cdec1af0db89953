"""``deploykit export triton``: the repository it writes, its config.pbtxt parsed by the ModelConfig
protobuf schema tritonclient[grpc] ships (so a field Triton does not know, or a wrong type, fails).
"""

from __future__ import annotations

import json

import pytest

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")

from google.protobuf import text_format  # noqa: E402

import converted_bundles  # noqa: E402
from deploykit_cli import run_deploykit  # noqa: E402

from deploykit.bundle.format import sha256_of  # noqa: E402
from deploykit.errors import BadInputError  # noqa: E402
from deploykit.export.triton import export_triton  # noqa: E402

ModelConfig = model_config_pb2.ModelConfig


def parsed(model_dir) -> model_config_pb2.ModelConfig:
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), ModelConfig())


def test_onnxruntime_repository_from_the_cli(tmp_path):
    bundle = converted_bundles.converted("tabular")
    result = run_deploykit("export", "triton", bundle, tmp_path / "repo", "--name", "tab", "--device", "cuda:1",
                           "--instances", "2", "--max-delay-ms", "5")
    assert result.returncode == 0, result.stderr
    model = tmp_path / "repo" / "tab"
    config = parsed(model)
    assert config.name == "tab" and config.platform == "onnxruntime_onnx" and config.max_batch_size == 4
    inputs = [(i.name, i.data_type, list(i.dims)) for i in config.input]
    assert inputs == [("features", model_config_pb2.TYPE_FP32, [13])]
    assert [list(o.dims) for o in config.output] == [[4], [16]]
    assert list(config.dynamic_batching.preferred_batch_size) == [1, 2, 4]
    assert config.dynamic_batching.max_queue_delay_microseconds == 5000
    group = config.instance_group[0]
    assert group.count == 2 and group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU and list(group.gpus) == [1]
    assert list(config.model_operations.op_library_filename) == ["/models/tab/libdeploykit_ort.so"]
    warmup = [(w.name, w.batch_size, w.count, list(w.inputs)) for w in config.model_warmup]
    assert warmup == [("batch_1", 1, 3, ["features"]), ("batch_2", 2, 3, ["features"]), ("batch_4", 4, 3, ["features"])]
    sample = config.model_warmup[0].inputs["features"]
    assert sample.random_data and list(sample.dims) == [13] and sample.data_type == model_config_pb2.TYPE_FP32
    assert sha256_of(model / "1" / "model.onnx") == sha256_of(bundle / "model.onnx")
    assert sha256_of(model / "libdeploykit_ort.so") == sha256_of(bundle / "libdeploykit_ort.so")
    readme = (model / "README.md").read_text()
    assert "ONNX Runtime **1." in readme and "tritonserver --model-repository=/models" in readme
    assert "tritonserver --model-repository=/models" in result.stderr


def test_tensorrt_plan_with_its_plugin_library(tmp_path):
    """An engine of full TensorRT (here: the RTX engine relabelled, which Triton would not run) and the
    plugin library it embeds, named in the tritonserver command."""
    bundle = converted_bundles.copy_bundle("tabular", tmp_path)
    if not any(e.get("plugin_library_sha256") for e in json.loads((bundle / "manifest.json").read_text())["engines"]):
        pytest.skip("no engine with plugins was built here (TensorRT-RTX missing)")
    converted_bundles.edit_manifest(bundle, lambda m: m["engines"][0].update(flavour="tensorrt", version="10.14.1"))
    result = export_triton(bundle, tmp_path / "repo", platform="tensorrt", device="cuda", server_repo="/srv/repo")
    config = parsed(result.model_dir)
    assert config.platform == "tensorrt_plan" and not config.HasField("model_operations")
    engine = next(bundle.glob("*.engine"))
    assert sha256_of(result.model_dir / "1" / "model.plan") == sha256_of(engine)
    assert (result.model_dir / "libdeploykit_trt.so").is_file()
    assert result.command.endswith("--backend-config=tensorrt,plugins=/srv/repo/tabular/libdeploykit_trt.so")
    assert "TensorRT **10.14.1**" in (result.model_dir / "README.md").read_text()


def test_refusals(tmp_path):
    bundle = converted_bundles.converted("tabular")
    with pytest.raises(BadInputError, match="TensorRT-RTX, which Triton's TensorRT backend does not run|no TensorRT"):
        export_triton(bundle, tmp_path, platform="tensorrt")
    export_triton(bundle, tmp_path, device="cpu")
    with pytest.raises(BadInputError, match="exists: pass --force"):
        export_triton(bundle, tmp_path, device="cpu")
    again = export_triton(bundle, tmp_path, device="cpu", force=True)
    assert parsed(again.model_dir).instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tabular"]  # no staging folder left
    result = run_deploykit("export", "triton", bundle, tmp_path, "--platform", "tensorrt", "--device", "cpu")
    assert result.returncode == 2 and "TensorRT runs on the GPU only" in result.stderr


def test_integer_inputs_warm_up_with_zeros_and_no_runs_means_no_warmup():
    from deploykit.export.triton import model_warmup

    inputs = [{"name": "input_ids", "dtype": "int64", "shape": ["batch", 128]},
              {"name": "pixels", "dtype": "float16", "shape": ["batch", 3, 8, 8]}]
    [entry] = model_warmup(inputs, [32], 2, batched=True)
    assert entry["name"] == "batch_32" and entry["batch_size"] == 32 and entry["count"] == 2
    ids, pixels = (sample["value"] for sample in entry["inputs"])
    assert ids["zero_data"] and ids["dims"] == [128] and pixels["random_data"] and pixels["dims"] == [3, 8, 8]
    assert model_warmup(inputs, [32], 0, batched=True) == []


def test_an_output_without_the_batch_dimension_batches_in_neither(tmp_path):
    """serve and export triton ask one rule: an output that is not split by the batch stops batching in both."""
    from deploykit.serving.models import ServeOptions, load_models

    bundle = converted_bundles.copy_bundle("tabular", tmp_path)
    converted_bundles.edit_manifest(bundle, lambda m: m["outputs"][1].update(shape=[16]))
    served = load_models([bundle], ServeOptions(devices=("cpu",)))[0]
    assert served.max_batch == 1 and not served.batching
    config = parsed(export_triton(bundle, tmp_path / "repo", device="cpu").model_dir)
    assert config.max_batch_size == 0 and not config.HasField("dynamic_batching")
    assert list(config.input[0].dims) == [-1, 13] and list(config.output[1].dims) == [16]
    assert not config.model_warmup  # a batch Triton does not know: no fixed size to warm up with


def test_python_platform_repository_from_the_cli(tmp_path):
    """The bundle copied whole, model.py importing deploykit's model, the consent flags as parameters,
    warm-up with zeros at every validated and tuned size, no preferred sizes (Triton would not wait to batch)."""
    bundle = converted_bundles.copy_bundle("tabular", tmp_path)
    tuning = {"device": "cuda", "gpu": None, "cuda_arch": None, "created": "now", "versions": {},
              "choices": [{"batch": 3, "backend": "onnxruntime", "p50_ms": 1.0}]}
    converted_bundles.edit_manifest(bundle, lambda m: m.update(tuning=tuning))
    result = run_deploykit("export", "triton", bundle, tmp_path / "repo", "--platform", "python", "--device", "cuda:1",
                           "--instances", "2", "--trust-bundle", "--allow-nan")
    assert result.returncode == 0, result.stderr
    model = tmp_path / "repo" / "tabular"
    config = parsed(model)
    assert config.backend == "python" and not config.platform and config.max_batch_size == 4
    assert not config.dynamic_batching.preferred_batch_size and config.dynamic_batching.max_queue_delay_microseconds
    group = config.instance_group[0]
    assert group.count == 2 and group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU and list(group.gpus) == [1]
    assert [(w.batch_size, w.inputs["features"].zero_data) for w in config.model_warmup] == [
        (1, True), (2, True), (3, True), (4, True)]
    assert {key: value.string_value for key, value in config.parameters.items()} == {
        "trust_native": "true", "allow_nan": "true"}
    assert "from deploykit.serving.triton_model import TritonPythonModel" in (model / "1" / "model.py").read_text()
    copied = model / "1" / "bundle"
    assert sorted(p.name for p in copied.iterdir()) == sorted([*json.loads((bundle / "manifest.json").read_text())[
        "files"], "manifest.json"])
    assert all(sha256_of(path) == sha256_of(bundle / path.name) for path in copied.iterdir())
    readme = (model / "README.md").read_text()
    assert "first `python3` on PATH" in readme and "LD_LIBRARY_PATH" in readme and "with `--trust-bundle`" in readme
    refused = run_deploykit("export", "triton", bundle, tmp_path / "repo", "--allow-nan", "--name", "ort")
    assert refused.returncode == 2 and "--allow-nan is for --platform python" in refused.stderr
