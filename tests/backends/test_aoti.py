"""AOTInductor packages on the CPU: ``convert --backend aoti`` compiles them (static and dynamic),
the manifest lists them as native code, the runner matches PyTorch and routes each batch to its
package, and a package loads only on the torch, CPU and GPU it was compiled for, with consent
where this machine's deploykit did not write it.

Compiling is C++ (gcc), about 6 s a package here: each bundle is converted once (converted_aoti).
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import deploykit
import model_zoo
from converted_bundles import aoti_source_model, converted_aoti, edit_manifest
from deploykit.backends.aoti import compat
from deploykit.bundle import trust
from deploykit.bundle.format import sha256_of
from deploykit.bundle.inspect import describe_bundle
from deploykit.conversion import aoti
from deploykit.conversion.loading import LoadedModel
from deploykit.errors import EXIT_BAD_INPUT, BadInputError, EnvironmentProblem
from deploykit.specs import BatchRange, InputSpec
from deploykit_cli import run_deploykit
from foreign_library import constructor_library

STATIC = {1: "aoti-cpu-b1.pt2", 2: "aoti-cpu-b2.pt2", 4: "aoti-cpu-b4.pt2"}
DYNAMIC = "aoti-cpu-dynamic.pt2"


@pytest.fixture(scope="module")
def bundle() -> Path:
    """tiny_conv, batch 1:2:4, both kinds: a dynamic package and one static package per validated size."""
    return converted_aoti()


@pytest.fixture(scope="module")
def model(bundle) -> torch.nn.Module:
    return aoti_source_model(bundle)


def images(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 3, 8, 8), dtype=np.float32)


def in_pytorch(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.from_numpy(x)).numpy()


def test_manifest_lists_each_package(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    entries = {entry["file"]: entry for entry in manifest["aoti"]}
    assert set(entries) == {DYNAMIC, *STATIC.values()}
    assert entries[DYNAMIC]["batch"] == {"min": 1, "opt": 2, "max": 4}
    for size, name in STATIC.items():
        assert entries[name]["batch"] == {"min": size, "opt": size, "max": size}
    for entry in entries.values():
        assert entry["device"] == "cpu" and entry["torch"] == torch.__version__ and entry["precision"] == "fp32"
        assert entry["cpu_isa"] in compat.cpu_isas() and entry["cuda_arch"] is None
        assert entry["validated"] is True and entry["cuda_graph"] is False and entry["inductor_configs"] == {}
    native = {entry["file"]: entry for entry in manifest["native"]}
    for name in entries:
        assert native[name]["kind"] == trust.AOTI_PACKAGE == "aoti-package"
        assert native[name]["sha256"] == manifest["files"][name]["sha256"] == sha256_of(bundle / name)
        assert zipfile.is_zipfile(bundle / name)
    report = json.loads((bundle / "report.json").read_text())
    labels = {c["label"]: c["passed"] for c in report["validation"]["candidates"]}
    assert labels["aoti cpu dynamic package"] and labels["aoti cpu static packages"]
    assert f"compiled by torch {torch.__version__} for this CPU" in report["aoti"]["note"]


def test_inspect_shows_the_packages(bundle):
    info = describe_bundle(bundle)
    shown = {p["file"]: p for p in info["aoti"]}
    assert shown[DYNAMIC]["batch"] == "1..4" and shown[STATIC[2]]["batch"] == "2"
    assert {n["file"] for n in info["native"] if n["kind"] == "aoti-package" and not n["needs_trust"]} == set(shown)
    result = run_deploykit("inspect", bundle)
    assert result.returncode == 0, result.stderr
    assert f"aoti: {DYNAMIC} (cpu, batch 1..4, fp32, torch {torch.__version__}" in result.stderr


@pytest.mark.parametrize("batch", [1, 3, 4])
def test_runner_matches_pytorch(bundle, model, batch):
    runner = deploykit.load(bundle, backend="aoti", device="cpu")
    assert runner.backend == "aoti" and runner.device == "cpu"
    x = images(batch, seed=batch)
    outputs = runner(x=x)
    assert list(outputs) == ["output"] and isinstance(outputs["output"], np.ndarray)
    np.testing.assert_allclose(outputs["output"], in_pytorch(model, x), rtol=1e-5, atol=1e-5)
    as_torch = runner(torch.from_numpy(x))["output"]
    assert isinstance(as_torch, torch.Tensor) and as_torch.device.type == "cpu"
    np.testing.assert_array_equal(as_torch.numpy(), outputs["output"])


def test_each_batch_goes_to_its_static_package_else_the_dynamic_one(bundle, model):
    both = deploykit.load(bundle, backend="aoti", device="cpu")
    dynamic = deploykit.load(bundle, backend="aoti", device="cpu", packages="dynamic")
    static = deploykit.load(bundle, backend="aoti", device="cpu", packages="static")
    for batch in (1, 2, 3, 4):
        x = images(batch)
        expected = in_pytorch(model, x)
        np.testing.assert_allclose(both(x)["output"], expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dynamic(x)["output"], expected, rtol=1e-5, atol=1e-5)
    assert both.served == {1: STATIC[1], 2: STATIC[2], 3: DYNAMIC, 4: STATIC[4]}
    assert dynamic.served == {1: DYNAMIC, 2: DYNAMIC, 3: DYNAMIC, 4: DYNAMIC}
    static(images(2))
    assert static.served == {2: STATIC[2]}
    with pytest.raises(BadInputError, match=r"batch 3: no AOTInductor package loaded here runs it .*aoti-cpu-b1.pt2 "
                                            r"\(batch 1\).*compiled for"):
        static(images(3))


def test_batch_outside_the_range_is_refused(bundle):
    runner = deploykit.load(bundle, backend="aoti", device="cpu")
    with pytest.raises(BadInputError, match="input x has batch 5, outside 1..4, the batches the bundle was validated"):
        runner(images(5))
    unvalidated = deploykit.load(bundle, backend="aoti", device="cpu", allow_unvalidated=True)
    with pytest.raises(BadInputError, match=r"batch 5: no AOTInductor package .*aoti-cpu-dynamic.pt2 \(batch 1..4\)"):
        unvalidated(images(5))  # the dynamic package's code assumes its range: not even with consent


@pytest.mark.slow
def test_fixed_batch_fp16_is_one_static_package(model):
    fixed = converted_aoti(None, "--precision", "fp16", "--io-precision", "fp16")
    manifest = json.loads((fixed / "manifest.json").read_text())
    (entry,) = manifest["aoti"]
    assert entry["file"] == "aoti-cpu-b1.pt2" and entry["batch"] == {"min": 1, "opt": 1, "max": 1}
    assert entry["precision"] == "fp16" and entry["validated"] is True
    runner = deploykit.load(fixed, backend="aoti", device="cpu")
    x = images(1).astype(np.float16)
    out = runner(x=x)["output"]
    assert out.dtype == np.float16  # the bundle's io dtype in and out
    np.testing.assert_allclose(out.astype(np.float32), in_pytorch(model, x.astype(np.float32)), rtol=0.05, atol=0.05)
    with pytest.raises(BadInputError, match="input x is float32, the model takes float16"):
        runner(x=images(1))


def test_wrong_device_and_options_are_clear(bundle):
    with pytest.raises(BadInputError, match="has AOTInductor packages for cpu only, not cuda: use device='cpu'"):
        deploykit.load(bundle, backend="aoti", device="cuda")
    with pytest.raises(BadInputError, match=r"threads do not apply to AOTInductor packages \(options: cuda_graph, "):
        deploykit.load(bundle, backend="aoti", device="cpu", threads=2)
    with pytest.raises(BadInputError, match="packages='fast': use one of both, static, dynamic"):
        deploykit.load(bundle, backend="aoti", device="cpu", packages="fast")
    with pytest.raises(BadInputError, match="has no AOTInductor package: convert with --backend aoti"):
        deploykit.load(_onnx_only(bundle), backend="aoti")


def _onnx_only(bundle: Path) -> Path:
    """A copy of ``bundle`` without its packages in the manifest."""
    copy = Path(shutil.copytree(bundle, bundle.parent / "onnx-only", dirs_exist_ok=True))
    edit_manifest(copy, lambda m: m.update(aoti=[]))
    return copy


# --------------------------------------------------------------------------- where a package runs


def _entry(bundle: Path, name: str = DYNAMIC) -> dict:
    return next(e for e in json.loads((bundle / "manifest.json").read_text())["aoti"] if e["file"] == name)


def test_compat_names_the_torch_the_arch_and_the_isa(bundle):
    entry = _entry(bundle)
    assert compat.package_problem_here(entry) is None
    other_torch = {**entry, "torch": "2.3.0+cu130"}
    assert compat.package_problem_here(other_torch) == (
        f"{DYNAMIC} was compiled by torch 2.3.0+cu130 and this is torch {torch.__version__}; an AOTInductor "
        "package runs only on the torch that compiled it: pip install torch==2.3.0, or convert with --backend "
        "aoti here")
    assert compat.package_problem({**entry, "torch": "2.14.1+cpu"}, "2.14.1+cu130", (), compat.cpu_isas()) is None
    other_isa = {**entry, "cpu_isa": "neon"}
    assert "compiled for the CPU vector instructions neon and this CPU offers" in compat.package_problem_here(other_isa)
    cuda = {**entry, "device": "cuda", "cuda_arch": "8.0", "gpu": "NVIDIA A100", "cpu_isa": None}
    h200 = (("NVIDIA H200", "9.0"),)
    assert compat.package_problem(cuda, entry["torch"], h200, []) == (
        f"{DYNAMIC} was compiled for compute capability 8.0 (NVIDIA A100) and this NVIDIA H200 is 9.0: convert "
        "with --backend aoti on this GPU")
    assert compat.package_problem(cuda, entry["torch"], "torch sees no CUDA GPU", []) == (
        f"{DYNAMIC} is compiled for CUDA and torch sees no CUDA GPU")
    assert compat.package_problem({**cuda, "cuda_arch": "9.0"}, entry["torch"], h200, []) is None


def test_a_package_of_another_torch_is_left_out_or_refused(bundle, tmp_path):
    copy = Path(shutil.copytree(bundle, tmp_path / "b"))

    def other_torch(manifest, names):
        for entry in manifest["aoti"]:
            if entry["file"] in names:
                entry["torch"] = "2.3.0"

    edit_manifest(copy, lambda m: other_torch(m, {STATIC[1]}))
    runner = deploykit.load(copy, backend="aoti", device="cpu")
    assert STATIC[1] not in [p.file for p in runner.packages]
    left_out = f"{STATIC[1]} left out: {STATIC[1]} was compiled by torch 2.3.0"
    assert any(note.startswith(left_out) for note in runner.notes)
    runner(images(1))
    assert runner.served == {1: DYNAMIC}
    edit_manifest(copy, lambda m: other_torch(m, {DYNAMIC, *STATIC.values()}))
    with pytest.raises(EnvironmentProblem, match=f"cannot run b's AOTInductor packages here: {DYNAMIC} was "
                                                 "compiled by torch 2.3.0"):
        deploykit.load(copy, backend="aoti", device="cpu")


def _gpus(monkeypatch, gpus: dict[int, tuple[str, tuple[int, int]]]) -> None:
    """torch sees ``gpus`` (index -> (name, capability)), as on a machine with those GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: gpus[index][0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: gpus[index][1])


def test_cuda_n_runs_the_package_for_gpu_n_each_package_checked_once(monkeypatch, tmp_path):
    """On cuda:1 the package must fit GPU 1 (an H200 here), not GPU 0 (an A100): the choice, the loader
    and the package loop share one check per package."""
    from deploykit.backends.aoti import bundle as aoti_bundle
    from deploykit.backends.aoti.loader import Package
    from deploykit.bundle.read import Bundle
    from deploykit.runtime import choose

    _gpus(monkeypatch, {0: ("NVIDIA A100", (8, 0)), 1: ("NVIDIA H200", (9, 0))})
    entry = {"file": "aoti-cuda.pt2", "device": "cuda", "cuda_arch": "9.0", "gpu": "NVIDIA H200",
             "torch": torch.__version__, "batch": {"min": 1, "max": 4}, "validated": True}
    spec = {"name": "x", "dtype": "float32", "shape": ["batch", 3]}
    opened = Bundle(tmp_path, {"validation": {"passed": True}, "aoti": [entry], "inputs": [spec], "outputs": [spec]})
    monkeypatch.setattr(choose, "open_bundle", lambda path: opened)
    monkeypatch.setattr(trust, "aoti_package", lambda bundle, e, verify, trust_native: tmp_path / e["file"])
    loaded, checked = [], []
    monkeypatch.setattr(aoti_bundle, "load_package", lambda path, e, index, graph: loaded.append(index) or Package(e, None))
    check = compat.package_problem_here
    monkeypatch.setattr(compat, "package_problem_here", lambda e, index=0: checked.append(index) or check(e, index))
    runner = deploykit.load(tmp_path, backend="aoti", device="cuda:1")
    assert runner.device_id == 1 and loaded == [1] and checked == [1]
    with pytest.raises(EnvironmentProblem, match=r"aoti-cuda.pt2 was compiled for compute capability 9.0 \(NVIDIA "
                                                 r"H200\) and this NVIDIA A100 is 8.0"):
        deploykit.load(tmp_path, backend="aoti", device="cuda:0")
    assert checked == [1, 0]


# --------------------------------------------------------------------------- trust


def _foreign_package(bundle: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of ``bundle`` whose dynamic package's .so is a library that writes a marker when loaded,
    the manifest's sha256 updated to match: what a stranger's bundle can carry."""
    copy = Path(shutil.copytree(bundle, tmp_path / "foreign"))
    marker = tmp_path / "marker"
    library = constructor_library(tmp_path, marker).read_bytes()
    source, target = copy / DYNAMIC, tmp_path / DYNAMIC
    with zipfile.ZipFile(source) as original, zipfile.ZipFile(target, "w") as rewritten:
        for item in original.infolist():
            data = original.read(item)
            rewritten.writestr(item, library if item.filename.endswith(".so") else data)
    shutil.move(target, source)
    edit_manifest(copy, lambda m: m["files"][DYNAMIC].update(sha256=sha256_of(source), bytes=source.stat().st_size))
    return copy, marker


def test_foreign_package_refused_without_consent(bundle, tmp_path):
    foreign, marker = _foreign_package(bundle, tmp_path)
    assert {n.file: n.known for n in trust.native_files(deploykit.runtime.open_bundle(foreign))}[DYNAMIC] is False
    with pytest.raises(trust.UntrustedNativeCode, match=f"{DYNAMIC} is native code this machine's deploykit did not "
                       r"build .*trust_native=True \(--trust-bundle\).*backend='onnxruntime'") as refused:
        deploykit.load(foreign, backend="aoti", device="cpu")
    assert refused.value.exit_code == EXIT_BAD_INPUT and not marker.exists()
    assert deploykit.load(foreign, device="cpu").backend == "onnxruntime"  # the graph still runs
    result = run_deploykit("run", foreign, "--backend", "aoti", "--device", "cpu")
    assert result.returncode == EXIT_BAD_INPUT and "--trust-bundle" in result.stderr and not marker.exists()


def test_foreign_package_loads_with_consent(bundle, tmp_path):
    foreign, marker = _foreign_package(bundle, tmp_path)
    with pytest.raises(EnvironmentProblem, match=f"cannot load {DYNAMIC}"):  # not a real package, but it ran
        deploykit.load(foreign, backend="aoti", device="cpu", trust_native=True)
    assert marker.read_text() == "loaded"


def test_changed_package_refused_before_it_loads(bundle, tmp_path):
    copy = Path(shutil.copytree(bundle, tmp_path / "changed"))
    with (copy / STATIC[2]).open("ab") as handle:
        handle.write(b"\0")
    with pytest.raises(BadInputError, match="sha256 mismatch"):
        deploykit.load(copy, backend="aoti", device="cpu", trust_native=True)


def test_manifest_with_a_bad_package_entry_is_refused(bundle, tmp_path):
    copy = Path(shutil.copytree(bundle, tmp_path / "bad"))
    edit_manifest(copy, lambda m: m["aoti"][0].update(device="tpu"))
    with pytest.raises(BadInputError, match=r"manifest.json: aoti.0.device: Input should be 'cpu' or 'cuda'"):
        deploykit.load(copy, backend="aoti")


# --------------------------------------------------------------------------- what cannot be compiled


def test_torchscript_is_a_clear_error(tmp_path):
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(model_zoo.tiny_conv().eval()), path)
    result = run_deploykit("convert", path, "--input", "x:1x3x8x8", "--backend", "aoti", "-o", tmp_path / "out")
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert "--backend aoti: TorchScript cannot be compiled by AOTInductor" in result.stderr
    assert "torch.export.save" in result.stderr and not (tmp_path / "out").exists()
    loaded = LoadedModel(torch.jit.load(path), "torchscript", path, ["x"])
    assert aoti.skip_reason(loaded, "all") == ("AOTInductor packages not compiled: TorchScript cannot be compiled "
                                               "by AOTInductor (it compiles torch.export programs)")


def test_all_skips_aoti_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    loaded = LoadedModel(model_zoo.tiny_conv().eval(), "module", Path("tiny.pt"), ["x"])
    assert "torch sees none here (--backend aoti compiles them for this CPU)" in aoti.skip_reason(loaded, "all")
    assert aoti.skip_reason(loaded, "aoti") is None


class _FixedBatch(torch.nn.Module):
    """Reshapes to a batch of 2: torch.export cannot make its batch dynamic."""

    def forward(self, x):
        return x.reshape(2, -1).sum(1)


def _stage(module: torch.nn.Module, shapes: str, sample: tuple[int, ...]):
    """The AOTInductor stage of ``module`` taking x of shape (batch, *sample), batch 1:2:4."""
    loaded = LoadedModel(module, "module", Path("m.pt"), ["x"])
    io = ([{"name": "x", "dtype": "float32", "shape": ["batch", *sample], "dynamic": {"0": {"min": 1, "opt": 2, "max": 4}}}],
          [{"name": "output", "dtype": "float32", "shape": ["batch"]}])
    return aoti.build_aoti_stage(loaded, [InputSpec("x", (2, *sample), "float32")], io, BatchRange(1, 2, 4),
                                 [1, 2, 4], shapes, "fp32")


def test_no_dynamic_batch_suggests_static():
    with pytest.raises(BadInputError, match=r"torch.export cannot export the model with a dynamic batch 1..4 for "
                                            r"AOTInductor: .*; pass --aoti-shapes static"):
        _stage(_FixedBatch(), "dynamic", (3,))


def test_missing_compiler_is_the_environment(monkeypatch):
    from torch._inductor import exc

    def no_compiler(*_args, **_kwargs):
        raise exc.InvalidCxxCompiler()

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    with pytest.raises(EnvironmentProblem, match=r"AOTInductor \(torch .*\) cannot compile here: .*install a C\+\+ "
                                                 "compiler"):
        _stage(model_zoo.tiny_conv().eval(), "dynamic", (3, 8, 8))


def test_deploykit_validate_runs_the_packages(bundle):
    result = run_deploykit("validate", bundle, bundle.parent / "tiny_conv.pt", "--factory", "model_zoo:tiny_conv",
                           "--backend", "aoti", "--device", "cpu", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] and report["backend"] == "aoti" and DYNAMIC in " ".join(report["packages"])
    assert [run["batch"] for run in report["validation"]["runs"]] == [1, 2, 4]
