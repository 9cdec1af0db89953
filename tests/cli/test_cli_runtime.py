"""``deploykit run | inspect | doctor | bench | profile`` through the CLI, on small bundles, on the CPU.

Bundles come from ``converted_bundles.converted`` (converted once per session). Doctor's rules are
also tested on made-up machines (an H200, a torch without kernels for the GPU), since this
one has no GPU.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

import deploykit
from deploykit.bundle import write
from deploykit.cli import main
from deploykit.tools import doctor
from deploykit.runtime import open_bundle
import mounts
from converted_bundles import converted, copy_bundle, edit_manifest
from deploykit_cli import run_deploykit


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run_deploykit(*args, cwd=cwd, columns=200, timeout=600)


@pytest.fixture(scope="module")
def tabular() -> Path:
    return converted("tabular")


# --------------------------------------------------------------------------- run


def test_run_writes_the_runtime_outputs(tmp_path, tabular):
    # float64 holding float32 values: the CLI casts it, as no value changes
    features = np.random.default_rng(3).standard_normal((4, 13), dtype=np.float32).astype(np.float64)
    np.savez(tmp_path / "x.npz", features=features)
    result = cli("run", tabular, "--inputs", tmp_path / "x.npz", "-o", tmp_path / "y.npz", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "output_0" in result.stderr and "4x16" in result.stderr
    expected = deploykit.load(tabular, device="cpu")(features.astype(np.float32))
    with np.load(tmp_path / "y.npz") as written:
        assert sorted(written.files) == ["output_0", "output_1"]
        for name, array in expected.items():
            np.testing.assert_array_equal(written[name], array)


def test_run_json_random_inputs(tabular):
    result = cli("run", tabular, "--json", "--batch", "3", "--no-op-library")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["backend"] == "onnxruntime" and summary["op_library"] is None
    assert summary["outputs"]["output_1"]["shape"] == [3, 16] and summary["inputs"] == "random (seed 0)"


def test_run_casts_exact_int64(tmp_path, tabular):
    np.savez(tmp_path / "x.npz", features=np.arange(-26, 26).reshape(4, 13))
    result = cli("run", tabular, "--inputs", tmp_path / "x.npz", "--device", "cpu", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["outputs"]["output_1"]["shape"] == [4, 16]


@pytest.mark.parametrize("arrays, message", [
    ({"features": np.full((2, 13), 1 + 2j)},
     "input features is complex128, the model takes float32, and the cast would change 26 of its values "
     "(e.g. (1+2j) becomes 1.0): save it as float32"),
    ({"features": np.full((2, 13), 1e300)},
     "input features is float64, the model takes float32, and the cast would change 26 of its values "
     "(e.g. 1e+300 becomes inf): save it as float32"),
    ({"features": np.full((2, 13), 2**24 + 1)}, "input features is int64, the model takes float32"),
    ({"features": np.zeros((2, 13), np.float32), "mask": np.zeros(2)},
     "holds mask, which the model has no input for; the model takes features (float32, batchx13): "
     "leave mask out of the .npz"),
    ({"features": np.zeros((6, 13), np.float32)},
     "input features has batch 6, outside 1..4, the batches the bundle was validated for: convert with a wider "
     "--batch, or pass --allow-unvalidated"),
], ids=["complex", "float64-overflow", "int64-rounding", "extra-array", "unvalidated-batch"])
def test_run_refuses_inputs_it_would_change_or_ignore(tmp_path, tabular, arrays, message):
    np.savez(tmp_path / "x.npz", **arrays)
    result = cli("run", tabular, "--inputs", tmp_path / "x.npz", "--device", "cpu", "-o", tmp_path / "y.npz")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "y.npz").exists()


def test_run_unvalidated_batch_only_when_allowed(tabular):
    refused = cli("run", tabular, "--batch", "8", "--device", "cpu")
    assert refused.returncode == 2 and "input features has batch 8, outside 1..4" in refused.stderr, refused.stderr
    note = "input features has batch 8, outside 1..4: its outputs were not validated"
    allowed = cli("run", tabular, "--batch", "8", "--device", "cpu", "--allow-unvalidated")
    assert allowed.returncode == 0 and f"note: {note}" in allowed.stderr, allowed.stderr
    as_json = cli("run", tabular, "--batch", "8", "--device", "cpu", "--allow-unvalidated", "--json")
    summary = json.loads(as_json.stdout)
    assert summary["outputs"]["output_0"]["shape"] == [8, 4] and any(n.startswith(note) for n in summary["notes"])


@pytest.mark.parametrize("case, code, message", [
    ("failed", 1, "failed validation against PyTorch"),
    ("changed", 2, "differs from the file deploykit validated"),
    ("engine", 3, "cannot run model.fp32.sm86_sm120.engine here"),
])
def test_run_exit_codes(tmp_path, case, code, message):
    bundle = copy_bundle("tabular", tmp_path)
    args = []
    if case == "failed":
        edit_manifest(bundle, lambda m: m["validation"].update(passed=False))
    elif case == "changed":
        (bundle / "model.onnx").write_bytes(b"x" + (bundle / "model.onnx").read_bytes())
    elif not open_bundle(bundle).engines:
        pytest.skip("no TensorRT here: the bundle has no engine")
    else:
        args = ["--backend", "tensorrt"]
    result = cli("run", bundle, *args)
    assert result.returncode == code and message in result.stderr, result.stderr


# --------------------------------------------------------------------------- doctor


def test_doctor_json_on_this_machine(tabular):
    result = cli("doctor", tabular, "--json")
    report = json.loads(result.stdout)
    by_area = {}
    for check in report["checks"]:
        by_area.setdefault(check["area"], []).append(check)
    assert {"GPU", "PyTorch", "nvcc", "ONNX Runtime", "deploykit libraries", "bundle files", "bundle validation"} <= set(by_area)
    assert by_area["bundle files"][0]["status"] == "ok" and by_area["deploykit libraries"][0]["status"] == "ok"
    assert report["environment"]["onnxruntime"]["version"]
    assert result.returncode == (0 if report["ok"] else 3)


def test_doctor_table_names_a_changed_file(tmp_path):
    bundle = copy_bundle("tabular", tmp_path)
    (bundle / "report.json").write_text("{}")
    result = cli("doctor", bundle)
    assert result.returncode == 3
    assert "report.json (sha256 mismatch)" in result.stderr and "re-run deploykit convert" in result.stderr


# --------------------------------------------------------------------------- inspect


def test_inspect_summarises_the_manifest(tabular):
    result = cli("inspect", tabular, "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["inputs"] == [{"name": "features", "dtype": "float32", "shape": "1..4x13"}]
    assert [o["shape"] for o in info["outputs"]] == ["1..4x4", "1..4x16"]
    assert info["custom_ops"] == ["MatMulRelu"] and info["op_library"] == "libdeploykit_ort.so"
    assert info["passes"]["fuse_matmul_relu"] and info["validation"]["passed"] and info["files_ok"]
    assert set(info["files"]) == set(open_bundle(tabular).manifest["files"])
    table = cli("inspect", tabular)
    assert "1..4x13" in table.stderr and "MatMulRelu" in table.stderr and "sha256 ok" in table.stderr
    assert "tolerances: the defaults" in table.stderr


def test_inspect_names_a_changed_file_with_exit_1(tmp_path):
    bundle = copy_bundle("tabular", tmp_path)
    (bundle / "report.json").write_text("{}")
    result = cli("inspect", bundle, "--json")
    assert result.returncode == 1
    info = json.loads(result.stdout)
    assert info["files"]["report.json"]["status"] == "sha256 mismatch" and not info["files_ok"]


def test_inspect_refuses_a_folder_that_is_no_bundle(tmp_path):
    result = cli("inspect", tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr and "manifest.json" in result.stderr


H200 = (("NVIDIA H200", "9.0"),)
TORCH = {"version": "2.14.1+cu130", "cuda": "13.0", "archs": ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"],
         "available": True}


def fake_env(**changes) -> doctor.Environment:
    base = dict(driver="580.82", driver_cuda="13.0", gpus=H200, torch=TORCH, nvcc="13.0",
                onnxruntime={"version": "1.32.0", "providers": ["CUDAExecutionProvider", "CPUExecutionProvider"],
                             "distributions": {"onnxruntime-gpu": "1.32.0"}},
                tensorrt={"tensorrt-rtx": "1.7.1.116"}, rtx_targets=("7.5", "8.0", "8.6", "8.9", "12.0", "12.1"),
                cuda_python="13.5.0", libraries={"libdeploykit_ort.so": "ok"})
    return doctor.Environment(**{**base, **changes})


def statuses(checks) -> dict[str, str]:
    return {f"{c.area}: {c.detail}": c.status for c in checks}


def test_doctor_healthy_machine_has_only_the_rtx_warning():
    checks, _ = doctor.diagnose(env=fake_env())
    bad = {k: v for k, v in statuses(checks).items() if v not in ("ok", "skip")}
    assert list(bad.values()) == ["warn"] and "does not run on NVIDIA H200 (9.0)" in next(iter(bad))


@pytest.mark.parametrize("archs, capability, runs", [
    (["sm_80", "sm_86"], "8.9", True),      # same major, newer minor: SASS runs
    (["sm_80", "sm_90"], "12.0", False),    # Blackwell needs sm_120 (or PTX)
    (["sm_80", "compute_90"], "12.0", True),  # PTX is JIT-compiled for newer GPUs
    (["sm_90a"], "9.0", True),
    (["sm_90a"], "9.1", False),
    (["sm_86"], "8.0", False),
])
def test_torch_kernel_coverage(archs, capability, runs):
    assert doctor.torch_runs_on(archs, capability) is runs


def test_doctor_explains_no_kernel_image():
    env = fake_env(gpus=(("NVIDIA RTX PRO 6000", "12.0"),), torch={**TORCH, "archs": ["sm_80", "sm_90"]})
    (check,) = doctor.check_torch(env)
    assert check.status == "fail" and "no kernel image is available" in check.detail and "sm_120" in check.detail
    assert "download.pytorch.org" in check.fix


def test_doctor_driver_older_than_torch_cuda():
    checks = doctor.check_torch(fake_env(driver_cuda="12.4"))
    assert checks[0].status == "fail" and "driver version is insufficient" in checks[0].detail


def installed_wheels(monkeypatch, versions: dict[str, str], imports: bool = True) -> None:
    """Make importlib.metadata report these ONNX Runtime distributions (and no other), and
    ``import onnxruntime`` fail unless ``imports``."""
    real = importlib.metadata.distribution

    def distribution(name):
        if name in ("onnxruntime", "onnxruntime-gpu"):
            if name not in versions:
                raise importlib.metadata.PackageNotFoundError(name)
            return SimpleNamespace(version=versions[name])
        return real(name)
    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    if not imports:
        monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import raises ImportError


@pytest.mark.parametrize("gpus, keep", [(H200, "onnxruntime-gpu==1.31.1"), ("no NVIDIA driver", "onnxruntime==1.32.0")])
def test_doctor_both_onnxruntime_wheels_names_the_one_to_keep(monkeypatch, gpus, keep):
    installed_wheels(monkeypatch, {"onnxruntime": "1.32.0", "onnxruntime-gpu": "1.31.1"})
    env = fake_env(gpus=gpus, onnxruntime=doctor._ort_facts())
    assert env.onnxruntime["distributions"] == {"onnxruntime": "1.32.0", "onnxruntime-gpu": "1.31.1"}
    (check,) = doctor.check_onnxruntime(env)
    assert check.status == "fail" and "onnxruntime 1.32.0, onnxruntime-gpu 1.31.1 are both installed" in check.detail
    assert check.fix == f"pip uninstall -y onnxruntime onnxruntime-gpu && pip install {keep}"


def test_doctor_both_wheels_that_no_longer_import_are_still_named(monkeypatch):
    installed_wheels(monkeypatch, {"onnxruntime": "1.32.0", "onnxruntime-gpu": "1.31.1"}, imports=False)
    (check,) = doctor.check_onnxruntime(fake_env(onnxruntime=doctor._ort_facts()))
    assert check.status == "fail" and "both installed" in check.detail
    assert check.fix.endswith("pip install onnxruntime-gpu==1.31.1")


@pytest.mark.parametrize("gpus, extra", [(H200, "deploykit[gpu]"), ("no NVIDIA driver", "deploykit[cpu]")])
def test_doctor_without_onnxruntime_names_the_extra(monkeypatch, gpus, extra):
    installed_wheels(monkeypatch, {}, imports=False)
    env = fake_env(gpus=gpus, onnxruntime=doctor._ort_facts())
    assert env.onnxruntime is None
    (check,) = doctor.check_onnxruntime(env)
    assert check.status == "fail" and "neither onnxruntime nor onnxruntime-gpu is installed" in check.detail
    assert check.fix == f"pip install '{extra}'"


def test_the_doctor_table_shows_the_extra_to_install(monkeypatch):
    installed_wheels(monkeypatch, {}, imports=False)
    monkeypatch.setenv("COLUMNS", "250")
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 3, result.output
    assert "neither onnxruntime nor onnxruntime-gpu is installed" in result.output
    assert "pip install 'deploykit[cpu]'" in result.output or "pip install 'deploykit[gpu]'" in result.output


def test_a_command_without_onnxruntime_is_exit_3_naming_the_extras(monkeypatch, tabular, tmp_path):
    installed_wheels(monkeypatch, {}, imports=False)
    np.savez(tmp_path / "x.npz", features=np.ones((2, 13), np.float32))
    result = CliRunner().invoke(main, ["run", str(tabular), "--device", "cpu", "--inputs", str(tmp_path / "x.npz"),
                                       "-o", str(tmp_path / "y.npz")])
    assert result.exit_code == 3, result.output
    assert "ONNX Runtime is not installed: pip install 'deploykit[cpu]'" in result.output
    assert "'deploykit[gpu]' on an NVIDIA GPU machine" in result.output and "internal error" not in result.output


def test_doctor_rtx_engine_on_hopper(tabular):
    bundle = open_bundle(tabular)
    if not bundle.engines:
        pytest.skip("no TensorRT here: the bundle has no engine")
    checks = {c.area: c for c in doctor.check_bundle(bundle, fake_env())}
    engine = checks["bundle engine"]
    assert engine.status == "fail" and "does not run on compute capability 9.0 (NVIDIA H200)" in engine.detail
    assert "pip install tensorrt" in engine.fix
    rtx_gpu = fake_env(gpus=(("NVIDIA RTX 6000 Ada", "8.9"),))
    assert "convert with --trt-targets 8.9" in doctor.check_bundle(bundle, rtx_gpu)[-1].fix
    ok = doctor.check_bundle(bundle, fake_env(gpus=(("NVIDIA RTX A6000", "8.6"),)))[-1]
    assert ok.status == "ok" and "runs on NVIDIA RTX A6000" in ok.detail


def test_doctor_names_foreign_engines_and_packages_and_what_runs_instead():
    from deploykit.bundle import trust

    env = fake_env(native=[trust.NativeFile("model.engine", trust.ENGINE, trust.FOREIGN),
                           trust.NativeFile("aoti-cpu.pt2", trust.AOTI_PACKAGE, trust.FOREIGN),
                           trust.NativeFile("libdeploykit_ort.so", trust.OP_LIBRARY, trust.WRITTEN_HERE)])
    engine, package, library = doctor.check_native(env)
    assert engine.status == "warn" and "deploykit runs the bundle on ONNX Runtime instead" in engine.detail
    assert package.status == "warn" and "--backend aoti refuses it; it is never replaced" in package.detail
    assert library.status == "ok" and library.detail.endswith(trust.WRITTEN_HERE)
    assert all("--trust-bundle loads it" in check.fix for check in (engine, package))
    assert [c.status for c in doctor.check_native(env, trust_native=True)] == ["ok"] * 3


# --------------------------------------------------------------------------- bench


def weights_of(bundle: Path) -> Path:
    return Path(json.loads((bundle / "manifest.json").read_text())["source"])


def test_bench_compares_backends_and_says_what_it_skipped(tmp_path, tabular):
    result = cli("bench", tabular, "--model", weights_of(tabular), "--factory", "model_zoo:tabular",
                 "--iterations", "5", "--warmup", "1", "--batch", "1,4", "--device", "cpu",
                 "--only", "pytorch,ort-plain,ort-functions,ort-deploykit,tensorrt", "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    entries = {entry["key"]: entry for entry in bench["contenders"]}
    assert [k for k, e in entries.items() if e["status"] == "ok"] == ["pytorch", "ort-functions", "ort-deploykit"]
    assert "not selected" in entries["torch-compile"]["reason"]
    assert "--plain-onnx" in entries["ort-plain"]["reason"] and "GPU only" in entries["tensorrt"]["reason"]
    for batch in (1, 4):
        rows = [r for e in entries.values() for r in e["results"] if r["batch"] == batch]
        assert len(rows) == 3 and min(r["vs_fastest"] for r in rows) == 1.0
        assert all(r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] and r["iterations"] == 5 for r in rows)
        assert all(r["throughput"] == pytest.approx(batch / (r["mean_ms"] / 1e3)) for r in rows)
    assert "ort-deploykit" in result.stderr and "skipped: ort-plain" in result.stderr


@pytest.mark.slow
def test_bench_torch_compile_and_plain_onnx(tmp_path, tabular):
    import onnx
    import onnx.inliner

    plain = tmp_path / "plain.onnx"  # the ONNX functions inlined stand in for a plain export here
    onnx.save_model(onnx.inliner.inline_local_functions(onnx.load(tabular / "model.onnx")), plain)
    result = cli("bench", tabular, "--factory", "model_zoo:tabular", "--model", weights_of(tabular),
                 "--iterations", "3", "--warmup", "1", "--batch", "2", "--device", "cpu", "--json",
                 "--only", "torch-compile,ort-plain", "--plain-onnx", plain, "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    entries = {e["key"]: e for e in json.loads(result.stdout)["contenders"]}
    assert entries["torch-compile"]["status"] == "ok", entries["torch-compile"]["reason"]
    assert entries["ort-plain"]["status"] == "ok", entries["ort-plain"]["reason"]


@pytest.mark.slow
def test_bench_export_plain_and_a_baseline_bundle(tmp_path, tabular):
    baseline = copy_bundle("tabular", tmp_path)
    result = cli("bench", tabular, "--factory", "model_zoo:tabular", "--model", weights_of(tabular), "--export-plain",
                 "--baseline", baseline, "--iterations", "3", "--warmup", "1", "--batch", "3", "--device", "cpu",
                 "--only", "pytorch,ort-plain,baseline,baseline-cuda-graph", "--json", "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    bench = json.loads(result.stdout)
    entries = {e["key"]: e for e in bench["contenders"]}
    for key in ("pytorch", "ort-plain", "baseline"):
        assert entries[key]["status"] == "ok" and entries[key]["results"][0]["batch"] == 3, entries[key]["reason"]
    assert "baseline bundle tabular (fp32)" in entries["baseline"]["label"]
    assert "need a GPU" in entries["baseline-cuda-graph"]["reason"]
    assert bench["timing"] == "host clock around each call"


def test_bench_reduced_precision_pytorch_contenders_run_on_the_gpu_only(tmp_path):
    from deploykit.tools import bench as benchmark

    bundle = copy_bundle("tabular", tmp_path)
    edit_manifest(bundle, lambda m: m.update(precision="fp16"))
    source = benchmark.load_source(open_bundle(bundle), None, "model_zoo:tabular", False)
    found = {c.key: c for c in benchmark.contenders(open_bundle(bundle), benchmark.Settings([1]), source)}
    assert {"pytorch-fp16", "torch-compile-fp16"} <= found.keys() and "pytorch-bf16" not in found
    assert found["pytorch"].setup is not None and "GPU only" in found["pytorch-fp16"].reason


def test_bench_without_the_source_model_skips_pytorch(tmp_path):
    bundle = copy_bundle("tabular", tmp_path)
    edit_manifest(bundle, lambda m: m.update(source=str(tmp_path / "gone.pt")))
    result = cli("bench", bundle, "--iterations", "2", "--warmup", "0", "--only", "pytorch,ort-deploykit", "--json")
    entries = {e["key"]: e for e in json.loads(result.stdout)["contenders"]}
    assert "gone.pt" in entries["pytorch"]["reason"] and "pass --model" in entries["pytorch"]["reason"]
    assert entries["ort-deploykit"]["status"] == "ok" and (bundle / "bench.json").is_file()


def test_bench_state_dict_needs_its_factory(tabular):
    from deploykit.tools import bench as benchmark

    source = benchmark.load_source(open_bundle(tabular), None, None, False)
    assert source.loaded is None and "--factory" in source.reason


# --------------------------------------------------------------------------- profile


def test_profile_names_our_ops_and_writes_a_page(tmp_path, tabular):
    result = cli("profile", tabular, "--model", weights_of(tabular), "--factory", "model_zoo:tabular",
                 "--iterations", "4", "--warmup", "1", "--device", "cpu", "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    profile = json.loads((tmp_path / "profile.json").read_text())
    sections = {s["backend"].split(" ")[0]: s for s in profile["sections"]}
    ort_section, torch_section = sections["onnxruntime"], sections["pytorch"]
    assert ort_section["status"] == "ok" and ort_section["runs"] == 4 and profile["batch"] == 2
    custom = [layer for layer in ort_section["layers"] if layer["custom"]]
    assert [layer["op_type"] for layer in custom] == ["deploykit::MatMulRelu"] and custom[0]["calls"] == 4
    assert ort_section["custom_share"] == pytest.approx(custom[0]["share"])
    totals = [layer["total_ms"] for layer in ort_section["layers"]]
    assert totals == sorted(totals, reverse=True) and sum(l["share"] for l in ort_section["layers"]) == pytest.approx(1)
    assert {event["name"] for event in ort_section["timeline"]} == {l["name"] for l in ort_section["layers"]}
    assert {"Linear", "BatchNorm1d"} <= {t["op_type"] for t in torch_section["op_types"]}
    assert sections["tensorrt"]["status"] == "skipped"
    page = (tmp_path / "profile.html").read_text()
    assert page.count("data:image/png;base64,") == 6 and "deploykit::MatMulRelu" in page
    assert "deploykit::MatMulRelu" in result.stderr and "USDT" not in result.stderr


def test_profile_function_fallback_has_no_custom_ops(tabular, tmp_path):
    result = cli("profile", tabular, "--only", "onnxruntime", "--no-op-library", "--iterations", "2", "--json",
                 "-o", tmp_path)
    assert result.returncode == 0, result.stderr
    (section,) = json.loads(result.stdout)["sections"]
    assert section["custom_share"] == 0 and "inlined ONNX functions" in section["note"]


# --------------------------------------------------------------------------- where bench and profile write


@pytest.mark.parametrize("command, out, words", [
    ("bench", "/proc/deploykit-out", "cannot write in /proc"),
    ("profile", "file.txt/sub", "file.txt is not a directory"),
], ids=["bench-proc", "profile-under-a-file"])
def test_a_bad_results_folder_is_refused_before_any_timing(tmp_path, tabular, command, out, words):
    (tmp_path / "file.txt").write_text("x")
    result = cli(command, tabular, "--device", "cpu", "-o", out, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()  # one line: no stage ran before it
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert words in lines[0] and "choose another -o" in lines[0], result.stderr


def profile_in_process(bundle: Path, out: Path):
    return CliRunner().invoke(main, ["profile", str(bundle), "--only", "onnxruntime", "--iterations", "1",
                                     "--warmup", "0", "--device", "cpu", "-o", str(out)])


OLD_PROFILE = {"profile.json": b"{}", "profile.html": b"<html></html>"}


def earlier_profile(folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    for name, data in OLD_PROFILE.items():
        (folder / name).write_bytes(data)
    return folder


def test_a_full_disk_while_writing_the_profile_is_exit_3_and_keeps_the_earlier_one(tmp_path, tabular, monkeypatch):
    out = earlier_profile(tmp_path / "out")
    monkeypatch.setattr(write, "os", mounts.os_with(fdopen=mounts.filling_fdopen(100)))
    result = profile_in_process(tabular, out)
    assert result.exit_code == 3, result.output
    assert f"error: the disk of {out} is full (No space left on device) writing profile.json, profile.html" \
        in result.output and "Traceback" not in result.output, result.output
    assert {path.name: path.read_bytes() for path in out.iterdir()} == OLD_PROFILE  # no temporary left either


def test_an_interrupt_while_timing_says_nothing_was_written(tmp_path, tabular, monkeypatch):
    from deploykit.tools import profile as profiling

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(profiling, "run_profile", interrupted)
    result = profile_in_process(tabular, tmp_path / "out")
    assert result.exit_code == 130 and "interrupted; nothing was written" in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_an_interrupt_while_the_profile_lands_names_what_was_written(tmp_path, tabular, monkeypatch):
    out = earlier_profile(tmp_path / "out")

    def replace(source, target):
        os.kill(os.getpid(), signal.SIGTERM)  # held until both files are in place
        os.replace(source, target)
    monkeypatch.setattr(write, "os", mounts.os_with(replace=replace))
    result = profile_in_process(tabular, out)
    assert result.exit_code == 130, result.output
    assert f"interrupted; {out / 'profile.json'} and {out / 'profile.html'} had been written in full before it, " \
           "nothing else" in result.output, result.output
    assert json.loads((out / "profile.json").read_text())["sections"][0]["status"] == "ok"


@pytest.mark.parametrize("command", ["bench", "profile"])
def test_unknown_only_key_is_a_usage_error(tabular, command):
    """A contender that does not exist is the user's mistake (exit 2, with the choices), not our bug."""
    result = cli(command, tabular, "--only", "pytorch,nonsense")
    assert result.returncode == 2, result.stderr
    assert "unknown nonsense; choose from" in result.stderr and "internal error" not in result.stderr


@pytest.mark.parametrize(("installed", "status", "words"), [
    ({"openvino": "2026.4.1", "nncf": "3.4.0"}, "ok", "OpenVINO 2026.4.1, NNCF 3.4.0"),
    ({"openvino": "2026.4.1"}, "warn", "no NNCF, so no int8 models"),
    ({}, "skip", "bundles' OpenVINO models run in ONNX Runtime instead"),
])
def test_doctor_says_what_openvino_can_do_here(installed, status, words):
    (check,) = doctor.check_openvino(fake_env(openvino=installed))
    assert check.status == status and words in check.detail
    assert (check.fix == "pip install 'deploykit[openvino]'") is (status != "ok")
