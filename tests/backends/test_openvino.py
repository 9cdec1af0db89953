"""``convert --backend openvino``: an OpenVINO model for the CPU beside the ONNX graph (fp32, or int8 by NNCF on
the same calibration batches), validated against PyTorch like every candidate, run by ``deploykit.load`` and
timed by ``tune``; without OpenVINO the bundle runs in ONNX Runtime as before.

The models' BatchNorm statistics are measured on random inputs; the calibration samples are random too, but
given with ``--calibration`` they stand for a user's data.
"""

import json
import shutil
import threading

import numpy as np
import pytest
import torch

import deploykit
import model_zoo
from deploykit.bundle.schema import Manifest
from deploykit.bundle.read import FileProblem, open_bundle
from deploykit.errors import BadInputError
from deploykit.testing import calibrate_batch_norm
from deploykit.tuning.candidates import find_candidates
from deploykit.validation.compare import compare_output, parse_tolerances
from deploykit_cli import assert_rejected, convert, run_deploykit

pytest.importorskip("openvino")
pytest.importorskip("nncf")

IMAGE = (3, 16, 16)
INT8_LABEL = "OpenVINO model int8 (NNCF)"


@pytest.fixture(scope="module")
def int8(tmp_path_factory):
    """residual_conv (its last BatchNorm stays deploykit's FusedBatchNorm) in int8 for ONNX Runtime and
    OpenVINO, 64 calibration samples, batch 1:4:8: (folder, the model, convert's result)."""
    folder = tmp_path_factory.mktemp("openvino")
    torch.manual_seed(0)
    model = calibrate_batch_norm(model_zoo.residual_conv(), [torch.randn(32, *IMAGE)], seed=1).eval()
    torch.save(model.state_dict(), folder / "weights.pt")
    np.savez(folder / "calibration.npz", x=np.random.default_rng(5).standard_normal((64, *IMAGE), dtype=np.float32))
    result = convert(folder, "weights.pt", "--factory", "model_zoo:residual_conv", "--input", "x:1x3x16x16",
                     "--batch", "1:4:8", "--precision", "int8", "--calibration", "calibration.npz",
                     "--backend", "openvino", "-o", "bundle")
    return folder, model, result


def _matches_pytorch(model, runner, x: np.ndarray) -> bool:
    with torch.no_grad():
        reference = model(torch.from_numpy(x)).numpy()
    tolerance = parse_tolerances([], "int8", ["output"])["output"]
    return compare_output("output", reference, runner(x=x)["output"], tolerance).passed


def test_the_openvino_model_is_validated_and_shipped(int8):
    folder, _, result = int8
    assert result.returncode == 0, result.stderr
    assert f"{INT8_LABEL} (openvino-cpu): pass" in result.stderr
    manifest = json.loads((folder / "bundle" / "manifest.json").read_text())
    Manifest.model_validate(manifest)
    (entry,) = manifest["openvino"]
    assert entry["file"] == "model.int8.openvino.xml" and entry["weights"] == "model.int8.openvino.bin"
    assert entry["precision"] == "int8" and entry["validated"] and entry["fake_quantize"] > 0
    assert entry["openvino"] == manifest["versions"]["openvino"] and entry["nncf"] == manifest["versions"]["nncf"]
    assert "without deploykit's ops" in entry["source"]  # the FusedBatchNorm graph is not what OpenVINO read
    assert {entry["file"], entry["weights"]} <= set(manifest["files"])
    report = json.loads((folder / "bundle" / "report.json").read_text())
    candidate = next(c for c in report["validation"]["candidates"] if c["label"] == INT8_LABEL)
    assert candidate["passed"] and candidate["backend"] == "openvino-cpu"
    assert report["openvino"]["validated"]
    page = (folder / "bundle" / "report.html").read_text()
    assert "<h2>OpenVINO model</h2>" in page and f"NNCF {entry['nncf']}" in page and "<strong>validated</strong>" in page
    assert manifest["model"] == "model.onnx"  # ONNX Runtime's int8 graph still ships


def test_load_runs_it_on_the_cpu_as_validated(int8):
    folder, model, _ = int8
    bundle = folder / "bundle"
    runner = deploykit.load(bundle, device="cpu", spin=False)  # serve passes spin on the CPU whatever runs
    assert runner.backend == "openvino" and runner.describe()["model"] == "model.int8.openvino.xml"
    x = np.random.default_rng(7).standard_normal((3, *IMAGE), dtype=np.float32)  # a batch validation did not run
    assert _matches_pytorch(model, runner, x)
    outputs = runner(x=torch.from_numpy(x))
    assert isinstance(outputs["output"], torch.Tensor)
    with pytest.raises(BadInputError, match="batch"):
        runner(x=np.zeros((9, *IMAGE), np.float32))
    ort = deploykit.load(bundle, "onnxruntime", "cpu")
    assert ort.backend == "onnxruntime" and _matches_pytorch(model, ort, x)
    assert deploykit.load(bundle, "openvino", threads=1).backend == "openvino"


def test_one_runner_serves_several_threads(int8):
    folder, _, _ = int8
    runner = deploykit.load(folder / "bundle", "openvino")
    inputs = [np.random.default_rng(seed).standard_normal((4, *IMAGE), dtype=np.float32) for seed in range(4)]
    expected = [runner(x=x)["output"] for x in inputs]
    got = [None] * len(inputs)

    def call(index: int) -> None:
        for _ in range(20):
            got[index] = runner(x=inputs[index])["output"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(np.array_equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"backend": "openvino", "device": "cuda"}, "OpenVINO runs the bundle on the CPU"),
    ({"backend": "openvino", "cuda_graph": True}, "cuda_graph do not apply to OpenVINO"),
])
def test_load_refuses_what_openvino_does_not_do(int8, kwargs, words):
    folder, _, _ = int8
    with pytest.raises(BadInputError, match=words):
        deploykit.load(folder / "bundle", **kwargs)


def test_a_bundle_without_openvino_model_says_how_to_make_one(tmp_path):
    torch.manual_seed(0)
    torch.save(model_zoo.outlier_feature().eval().state_dict(), tmp_path / "weights.pt")
    assert convert(tmp_path, "weights.pt", "--factory", "model_zoo:outlier_feature", "--input", "x:1x16",
                   "-o", "bundle").returncode == 0
    with pytest.raises(BadInputError, match="convert with --backend openvino"):
        deploykit.load(tmp_path / "bundle", "openvino")


def test_changed_weights_are_refused(int8, tmp_path):
    folder, _, _ = int8
    copy = tmp_path / "bundle"
    shutil.copytree(folder / "bundle", copy)
    weights = copy / "model.int8.openvino.bin"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(FileProblem, match="sha256"):
        deploykit.load(copy, "openvino")


def test_tune_times_it_beside_onnxruntime(int8, tmp_path):
    folder, _, _ = int8
    copy = tmp_path / "bundle"
    shutil.copytree(folder / "bundle", copy)
    opened = open_bundle(copy)
    (on_cpu,) = [c for c in find_candidates(opened, "cpu") if c.backend == "openvino"]
    assert on_cpu.problem is None and on_cpu.options == {"file": "model.int8.openvino.xml"}
    (on_gpu,) = [c for c in find_candidates(opened, "cuda") if c.backend == "openvino"]
    assert on_gpu.problem == "OpenVINO runs on the CPU only"
    result = run_deploykit("tune", copy, "--device", "cpu", "--json")
    assert result.returncode == 0, result.stderr
    tuning = json.loads((copy / "manifest.json").read_text())["tuning"]
    timed = [c for choice in tuning["choices"] for c in choice["candidates"] if c["backend"] == "openvino"]
    assert len(timed) == 3 and all(c["passed"] for c in timed)  # batch 1, 4, 8
    runner = deploykit.load(copy, device="cpu")
    assert runner.backend == "tuned" and any("openvino" in note or "onnxruntime" in note for note in runner.notes)


@pytest.fixture
def no_openvino(tmp_path):
    """An environment where ``import openvino`` fails, as where the extra is not installed."""
    blocked = tmp_path / "blocked" / "openvino"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('openvino is not installed here (test)')\n")
    return {"PYTHONPATH": str(blocked.parent)}


def test_without_openvino_the_bundle_runs_in_onnxruntime(int8, no_openvino):
    folder, _, _ = int8
    result = run_deploykit("run", folder / "bundle", "--device", "cpu", "--json", env=no_openvino)
    assert result.returncode == 0, result.stderr
    ran = json.loads(result.stdout)
    assert ran["backend"] == "onnxruntime"
    assert any("OpenVINO model not used" in note and "deploykit[openvino]" in note for note in ran["notes"])
    asked = run_deploykit("run", folder / "bundle", "--backend", "openvino", env=no_openvino)
    assert asked.returncode == 3 and "pip install 'deploykit[openvino]'" in asked.stderr, asked.stderr
    assert "Traceback" not in asked.stderr


def test_convert_without_openvino_stops_before_any_work(int8, no_openvino, tmp_path):
    folder, _, _ = int8
    result = run_deploykit("convert", folder / "weights.pt", "--factory", "model_zoo:residual_conv", "--input",
                           "x:1x3x16x16", "--backend", "openvino", "-o", tmp_path / "bundle", env=no_openvino)
    assert result.returncode == 3 and "pip install 'deploykit[openvino]'" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "bundle").exists()


def test_precisions_openvino_does_not_build_are_refused(tmp_path):
    torch.manual_seed(0)
    torch.save(model_zoo.outlier_feature().eval().state_dict(), tmp_path / "weights.pt")
    result = convert(tmp_path, "weights.pt", "--factory", "model_zoo:outlier_feature", "--input", "x:1x16",
                     "--precision", "fp16", "--backend", "openvino", "-o", "bundle")
    assert_rejected(result, "--backend openvino builds fp32 or int8 models, not fp16")


def test_auto_fix_keeps_the_same_nodes_float_in_openvino(tmp_path):
    """A hidden feature 200x the others breaks both int8 graphs; auto-fix keeps the nodes it ranks worst in float
    in ONNX Runtime's graph and in NNCF's quantization alike (OpenVINO names a Gemm's ops after the node)."""
    torch.manual_seed(0)
    torch.save(model_zoo.outlier_feature().eval().state_dict(), tmp_path / "weights.pt")
    np.savez(tmp_path / "calibration.npz", x=np.random.default_rng(5).standard_normal((64, 16), dtype=np.float32))
    args = ["weights.pt", "--factory", "model_zoo:outlier_feature", "--input", "x:1x16", "--batch", "1:4:8",
            "--precision", "int8", "--calibration", "calibration.npz", "--backend", "openvino"]
    plain = convert(tmp_path, *args, "-o", "plain")
    assert plain.returncode == 1 and f"✗ {INT8_LABEL}" in plain.stderr, plain.stderr
    fixed = convert(tmp_path, *args, "--auto-fix", "-o", "fixed")
    assert fixed.returncode == 0, fixed.stderr
    manifest = json.loads((tmp_path / "fixed" / "manifest.json").read_text())
    (entry,) = manifest["openvino"]
    kept = json.loads((tmp_path / "fixed" / "report.json").read_text())["precision"]["auto_fix"]["kept_float"]
    assert set(entry["kept_float"]) == {k["node"] for k in kept} and entry["validated"]
    before = json.loads((tmp_path / "plain" / "manifest.json").read_text())["openvino"][0]
    assert entry["fake_quantize"] < before["fake_quantize"]


@pytest.mark.parametrize("precision", ["fp32", pytest.param("int8", marks=pytest.mark.slow)])
def test_a_transformers_bert_converts_with_attention_fused(tmp_path, precision):
    """transformers' BertModel (from a config, random weights): ONNX Runtime's graph has its fused Attention,
    which OpenVINO reads too; dynamic batch 1:2:4."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    torch.save(model_zoo.bert_tiny().state_dict(), tmp_path / "weights.pt")
    result = convert(tmp_path, "weights.pt", "--factory", "model_zoo:bert_tiny", "--input", "input_ids:2x16:int64",
                     "--input", "attention_mask:2x16:int64", "--batch", "1:2:4", "--precision", precision,
                     "--backend", "openvino", "-o", "bundle")
    assert result.returncode == (0 if precision == "fp32" else 5), result.stderr  # int8: random calibration
    report = json.loads((tmp_path / "bundle" / "report.json").read_text())
    label = INT8_LABEL if precision == "int8" else "OpenVINO model fp32"
    assert next(c for c in report["validation"]["candidates"] if c["label"] == label)["passed"]
    assert report["openvino"]["source"] == "the fp32 graph the ONNX graph was made from"
    assert "<h2>OpenVINO model</h2>" in (tmp_path / "bundle" / "report.html").read_text()
    feeds = {"input_ids": np.arange(48, dtype=np.int64).reshape(3, 16) % 1000, "attention_mask": np.ones((3, 16), np.int64)}
    runner = deploykit.load(tmp_path / "bundle", device="cpu")
    assert runner.backend == "openvino" and runner(feeds)["output"].shape == (3, 16, 64)


def test_bench_times_it_beside_onnxruntime(int8, tmp_path):
    folder, _, _ = int8
    result = run_deploykit("bench", folder / "bundle", "--only", "ort-deploykit,openvino", "--device", "cpu",
                           "--batch", "4", "--warmup", "1", "--iterations", "5", "--rounds", "1",
                           "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    contenders = {c["key"]: c for c in json.loads((tmp_path / "bench.json").read_text())["contenders"]}
    assert contenders["openvino"]["status"] == "ok" and contenders["openvino"]["results"][0]["p50_ms"] > 0
    assert contenders["ort-deploykit"]["status"] == "ok"


def test_a_graph_openvino_cannot_convert_is_exit_3_naming_the_way_out(monkeypatch):
    """OpenVINO refusing a graph ONNX Runtime runs is a backend that cannot build the model, not a bug of ours."""
    import onnx
    import openvino
    from onnx import helper

    from deploykit.conversion.openvino import OpenVinoStage
    from deploykit.errors import EnvironmentProblem

    def refuse(_path):
        raise RuntimeError("Check 'unknown_operators.empty()' failed at frontend: OpenVINO does not support Foo")

    monkeypatch.setattr(openvino, "convert_model", refuse)
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    with pytest.raises(EnvironmentProblem, match="cannot build this model .*does not support Foo.*without --backend"):
        OpenVinoStage.build(helper.make_model(graph), ([], []), "", "fp32", None)
    assert EnvironmentProblem.exit_code == 3


def test_doctor_says_when_the_model_will_not_be_used_or_runs_another_openvino(int8):
    from deploykit.tools import doctor

    folder, _, _ = int8
    bundle = open_bundle(folder / "bundle")
    env = doctor.gather(bundle)
    assert not [c for c in doctor.check_bundle(bundle, env) if c.area == "bundle OpenVINO model"]
    env.openvino = {}
    (missing,) = [c for c in doctor.check_bundle(bundle, env) if c.area == "bundle OpenVINO model"]
    assert missing.status == "warn" and "is not used" in missing.detail and "deploykit[openvino]" in missing.fix
    env.openvino = {"openvino": "2099.1.0"}
    (other,) = [c for c in doctor.check_bundle(bundle, env) if c.area == "bundle OpenVINO model"]
    assert "this machine has 2099.1.0" in other.detail and other.fix.startswith("pip install openvino==")


def test_serve_answers_from_the_openvino_model(int8):
    """deploykit serve on the CPU: load's auto choice is the OpenVINO model (serve's ONNX Runtime hint `spin`
    does not get in its way), and tritonclient's answer is what the same runner gives in this process."""
    tritonhttp = pytest.importorskip("tritonclient.http")
    pytest.importorskip("fastapi")
    from serving import running_server

    folder, _, _ = int8
    x = np.random.default_rng(11).standard_normal((2, *IMAGE), dtype=np.float32)
    expected = deploykit.load(folder / "bundle", "openvino")(x=x)["output"]
    with running_server(folder / "bundle", "--device", "cpu") as server:
        with tritonhttp.InferenceServerClient(server.url) as client:
            tensor = tritonhttp.InferInput("x", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            answer = client.infer("bundle", [tensor]).as_numpy("output")
        assert "openvino" in server.output()
    np.testing.assert_allclose(answer, expected, rtol=1e-5, atol=1e-6)


def test_each_output_comes_back_by_name(tmp_path):
    """tabular's two outputs (4 classes, 16 features): OpenVINO's output ports are matched to the manifest's
    outputs by name, whatever order it keeps them in."""
    torch.manual_seed(0)
    torch.save(model_zoo.tabular().state_dict(), tmp_path / "weights.pt")
    result = convert(tmp_path, "weights.pt", "--factory", "model_zoo:tabular", "--input", "features:1x13",
                     "--batch", "1:4:8", "--backend", "openvino", "-o", "bundle")
    assert result.returncode == 0, result.stderr
    features = np.random.default_rng(3).standard_normal((5, 13), dtype=np.float32)
    ours = deploykit.load(tmp_path / "bundle", "openvino")(features=features)
    reference = deploykit.load(tmp_path / "bundle", "onnxruntime", "cpu")(features=features)
    assert list(ours) == ["output_0", "output_1"]
    for name, value in reference.items():
        np.testing.assert_allclose(ours[name], value, rtol=1e-5, atol=1e-6)
