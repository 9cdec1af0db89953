"""Native code from a bundle runs only when this machine's deploykit made it, or with consent:
the decision (deploykit.bundle.trust) as deploykit.load, inspect and the manifest see it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import deploykit
from deploykit.bundle import trust
from deploykit.bundle.inspect import describe_bundle
from deploykit.bundle.read import Bundle, open_bundle
from deploykit.errors import EXIT_BAD_INPUT, EnvironmentProblem
from deploykit.bundle.format import sha256_of
from converted_bundles import converted, copy_bundle, edit_manifest
from foreign_library import LIBRARY, foreign_bundle


@pytest.fixture
def no_local_build(monkeypatch):
    """This machine cannot build the op library, so a foreign one cannot be swapped for it."""
    def cannot_build(before_building=None):
        raise EnvironmentProblem("no toolchain")
    monkeypatch.setattr(trust.native, "find_ort_library", cannot_build)


def test_foreign_library_refused_without_consent(tmp_path, no_local_build):
    bundle, marker = foreign_bundle(tmp_path)
    with pytest.raises(trust.UntrustedNativeCode, match=f"{LIBRARY} is native code this machine's deploykit did "
                       r"not build .*unchanged since the manifest was written.*trust_native=True \(--trust-bundle\)"
                       r".*op_library=False \(--no-op-library\)") as refused:
        deploykit.load(bundle, device="cpu")
    assert refused.value.exit_code == EXIT_BAD_INPUT and not marker.exists()
    assert deploykit.load(bundle, device="cpu", op_library=False).library is None and not marker.exists()


def test_foreign_library_loads_with_consent(tmp_path, no_local_build):
    bundle, marker = foreign_bundle(tmp_path)
    assert deploykit.load(bundle, device="cpu", trust_native=True).library == bundle / LIBRARY
    assert marker.read_text() == "loaded"


BUILD_ANNOUNCED = "building deploykit's op library from its sources"


def test_foreign_library_replaced_by_this_machines_build(tmp_path, caplog):
    bundle, marker = foreign_bundle(tmp_path)
    runner = deploykit.load(bundle, device="cpu")
    assert runner.library == trust.native.find_ort_library() and not marker.exists()
    assert any("was not built here: using this machine's build" in note for note in runner.notes)
    assert BUILD_ANNOUNCED not in caplog.text  # the build was cached: nothing to wait for, nothing said


def test_a_build_on_a_cold_cache_is_announced_before_it_starts(tmp_path, monkeypatch, caplog):
    """deploykit.load replacing a foreign op library on an empty cache starts CMake (minutes): it says
    so first, and how to skip it. The toolchain, headers and build are stand-ins: no real build."""
    bundle, marker = foreign_bundle(tmp_path)  # converted before the cache is emptied
    monkeypatch.setenv("DEPLOYKIT_CACHE", str(tmp_path / "cache"))
    native = trust.native
    monkeypatch.setattr(native, "find_toolchain", lambda: native.Toolchain("cmake", "3.30", "Ninja", "ninja", "c++"))
    monkeypatch.setattr(native, "fetch_headers", lambda verbose=False: native.Headers(None, None, None, {}))
    said_before_building = []

    def build(build_dir, *_args):
        said_before_building.append(caplog.text)
        raise EnvironmentProblem("no build in this test")

    monkeypatch.setattr(native, "_build", build)
    with caplog.at_level(logging.WARNING, logger=trust.__name__), pytest.raises(trust.UntrustedNativeCode):
        deploykit.load(bundle, device="cpu")
    [said] = said_before_building
    assert BUILD_ANNOUNCED in said and f"cached in {tmp_path / 'cache' / 'build'}" in said, said
    assert f"the bundle's {LIBRARY} was not built here" in said and "--trust-bundle" in said, said
    assert "--no-op-library" in said and not marker.exists()


def test_unchanged_library_loads_without_consent(no_local_build):
    bundle = converted("tabular")
    runner = deploykit.load(bundle, device="cpu")
    assert runner.library == bundle / LIBRARY
    assert trust.native_files(open_bundle(bundle))[0].known


def test_changed_library_refused_before_the_decision(tmp_path, no_local_build):
    bundle, marker = foreign_bundle(tmp_path)
    (bundle / LIBRARY).write_bytes((bundle / LIBRARY).read_bytes() + b"\0")
    with pytest.raises(deploykit.errors.BadInputError, match="sha256 mismatch"):
        deploykit.load(bundle, device="cpu", trust_native=True)
    assert not marker.exists()


def test_inspect_names_foreign_native_files(tmp_path):
    bundle, _ = foreign_bundle(tmp_path)
    assert describe_bundle(bundle)["native"][0] == {
        "file": LIBRARY, "kind": trust.OP_LIBRARY, "provenance": trust.FOREIGN, "needs_trust": True}
    assert not any(n["needs_trust"] for n in describe_bundle(converted("tabular"))["native"])


def test_manifest_and_report_record_native_files():
    manifest = open_bundle(converted("tabular")).manifest
    [entry] = [n for n in manifest["native"] if n["kind"] == trust.OP_LIBRARY]
    assert entry["file"] == LIBRARY and entry["sha256"] == manifest["files"][LIBRARY]["sha256"]
    assert entry["deploykit"] and entry["build"]
    assert "Native code in the bundle" in (converted("tabular") / "report.html").read_text()


def _engine_bundle(tmp_path, plugins: bool) -> tuple[Bundle, dict]:
    entry = {"file": "model.engine", "plugin_library_sha256": "ab" * 32 if plugins else None,
             "plugin_layers": 2 if plugins else 0}
    manifest = {"engines": [entry], "files": {"model.engine": {"sha256": "cd" * 32}}}
    return Bundle(tmp_path, manifest), entry


def test_engine_with_plugins_needs_consent(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPLOYKIT_CACHE", str(tmp_path / "cache"))
    bundle, entry = _engine_bundle(tmp_path, plugins=True)
    with pytest.raises(trust.UntrustedNativeCode, match=r"model.engine is native code.*--trust-bundle.*"
                                                         r"--backend onnxruntime"):
        trust.engine_host_code_allowed(bundle, entry)
    assert trust.engine_host_code_allowed(bundle, entry, trust_native=True)
    trust.record_written(["cd" * 32])  # convert wrote this engine on this machine
    assert trust.engine_host_code_allowed(bundle, entry)
    assert trust.native_files(bundle)[0].provenance == trust.WRITTEN_HERE


def test_engine_without_plugins_runs_no_host_code(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPLOYKIT_CACHE", str(tmp_path / "cache"))
    bundle, entry = _engine_bundle(tmp_path, plugins=False)
    assert trust.engine_host_code_allowed(bundle, entry) is False and trust.native_files(bundle) == []


def _engine_of(bundle):
    opened = open_bundle(bundle)
    entries = [e for e in opened.engines if trust.has_plugins(e)]
    if not entries:
        pytest.skip("no TensorRT here: the bundle has no engine with plugins")
    return opened, entries[0]


def test_bundle_engine_deserialized_with_host_code_only_when_known(tmp_path, monkeypatch):
    """No GPU here: the runner is replaced by one that records whether host code would be allowed."""
    from deploykit.backends.tensorrt import bundle as trt_bundle

    class Deserialized(Exception):
        pass

    def record(*args, host_code, **kwargs):
        raise Deserialized(host_code)

    monkeypatch.setattr(trt_bundle, "TensorRTRunner", record)
    with pytest.raises(Deserialized) as deserialized:
        trt_bundle.load_tensorrt_engine(*_engine_of(converted("tabular")))
    assert deserialized.value.args == (True,)
    bundle = copy_bundle("tabular", tmp_path)
    _, entry = _engine_of(bundle)
    (bundle / entry["file"]).write_bytes(b"a stranger's engine")
    edit_manifest(bundle, lambda m: m["files"][entry["file"]].update(sha256=sha256_of(bundle / entry["file"])))
    with pytest.raises(trust.UntrustedNativeCode, match="--trust-bundle"):
        trt_bundle.load_tensorrt_engine(*_engine_of(bundle))
    with pytest.raises(Deserialized) as deserialized:
        trt_bundle.load_tensorrt_engine(*_engine_of(bundle), trust_native=True)
    assert deserialized.value.args == (True,)


def test_the_build_cache_is_hashed_once_per_process(tmp_path, monkeypatch):
    """Provenance asks about the build cache on every check: a library is hashed again only when it changes."""
    from deploykit.bundle import format

    monkeypatch.setenv("DEPLOYKIT_CACHE", str(tmp_path / "cache"))
    build = tmp_path / "cache" / "build" / "key"
    build.mkdir(parents=True)
    (build / "libours.so").write_bytes(b"a library")
    (build / trust.native.MANIFEST).write_text(json.dumps({"libraries": {"onnxruntime": "libours.so"}}))
    hashed, real = [], format.sha256_of
    monkeypatch.setattr(format, "sha256_of", lambda path: hashed.append(path.name) or real(path))
    monkeypatch.setattr(format, "_DIGESTS", {})
    digest = real(build / "libours.so")
    assert trust.provenance(digest) == trust.SAME_AS_BUILD and trust.provenance("0" * 64) == trust.FOREIGN
    assert hashed == ["libours.so"]
    (build / "libours.so").write_bytes(b"a library, rebuilt")
    assert trust.provenance(digest) == trust.FOREIGN and hashed == ["libours.so"] * 2


def test_a_conversion_hashes_each_native_file_once(tmp_path, monkeypatch):
    """The report, the manifest's native list and its files share one sha256 of the op library."""
    import model_zoo
    from deploykit.bundle import format, manifest, write
    from deploykit.conversion.options import ConvertOptions
    from deploykit.conversion.pipeline import convert
    from deploykit.specs import BatchRange, InputSpec

    torch.save(model_zoo.tabular().state_dict(), tmp_path / "tabular.pt")
    hashed, real = [], format.sha256_of
    for module in (format, manifest, write):
        monkeypatch.setattr(module, "sha256_of", lambda path: hashed.append(Path(path).name) or real(path))
    monkeypatch.setattr(format, "_DIGESTS", {})
    convert(ConvertOptions(tmp_path / "tabular.pt", tmp_path / "bundle", [InputSpec("features", (1, 13), "float32")],
                           batch=BatchRange(1, 2, 4), factory="model_zoo:tabular"))
    written = open_bundle(tmp_path / "bundle")
    assert written.op_library["file"] == LIBRARY and hashed.count(LIBRARY) == 1
    assert written.manifest["files"][LIBRARY]["sha256"] == real(tmp_path / "bundle" / LIBRARY)
    assert [n["sha256"] for n in written.manifest["native"]] == [written.manifest["files"][LIBRARY]["sha256"]]
