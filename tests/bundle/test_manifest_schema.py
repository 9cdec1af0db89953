"""A damaged or hostile manifest.json is refused on every open with one line naming the field
(exit 2, never "internal error"), and no file a manifest names may lead out of its bundle."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest

import deploykit
from converted_bundles import copy_bundle, edit_manifest
from deploykit.bundle.format import sha256_of
from deploykit.errors import BadInputError
from deploykit_cli import run_deploykit


def write(text):
    return lambda bundle: (bundle / "manifest.json").write_text(text)


def change(edit):
    return lambda bundle: edit_manifest(bundle, edit)


def version_1e400(bundle):
    text = (bundle / "manifest.json").read_text().replace('"format_version": 1', '"format_version": 1e400')
    (bundle / "manifest.json").write_text(text)


def linked_outside(bundle):
    (bundle.parent / "elsewhere.json").write_text((bundle / "manifest.json").read_text())
    (bundle / "manifest.json").unlink()
    os.symlink(bundle.parent / "elsewhere.json", bundle / "manifest.json")


def directory(bundle):
    (bundle / "manifest.json").unlink()
    (bundle / "manifest.json").mkdir()


#: case -> (how to damage the bundle's manifest, what the one line must say)
MANIFESTS = {
    "not json": (write("{not json"), "is not valid JSON"),
    "json list": (write("[1, 2]"), "holds a JSON list, not an object"),
    "json string": (write('"deploykit-bundle"'), "holds a JSON str, not an object"),
    "directory": (directory, "cannot read it"),
    "manifest linked outside": (linked_outside, "manifest.json leads outside the bundle"),
    "no inputs": (change(lambda m: m.pop("inputs")), "inputs: Field required"),
    "no outputs": (change(lambda m: m.pop("outputs")), "outputs: Field required"),
    "no files": (change(lambda m: m.pop("files")), "files: Field required"),
    "shape not a list": (change(lambda m: m["inputs"][0].update(shape="batchx13")), "inputs.0.shape: "),
    "dtype unknown": (change(lambda m: m["outputs"][1].update(dtype="complex-ish")), "outputs.1.dtype: unknown dtype"),
    "sha256 a number": (change(lambda m: m["files"]["model.onnx"].update(sha256=7)), "files.model.onnx.sha256: "),
    "version one": (change(lambda m: m.update(format_version="one")), "format_version: Input should be a valid integer"),
    "version 1e400": (version_1e400, "format_version: Input should be a valid integer"),
    "version negative": (change(lambda m: m.update(format_version=-5)), "format_version: Input should be greater"),
    "validation passed": (change(lambda m: m.update(validation="passed")), "validation: Input should be a valid dictionary"),
    "validation null": (change(lambda m: m.update(validation=None)), "validation: Input should be a valid dictionary"),
    "huge shape": (change(lambda m: m["inputs"][0]["shape"].__setitem__(1, 10**12)), "inputs.0.shape.1: a dimension is"),
    "batch range reversed": (change(lambda m: m["inputs"][0]["dynamic"]["0"].update(min=8)), "inputs.0.dynamic.0"),
    "model absolute": (change(lambda m: m.update(model="/etc/passwd")), "model: not a plain file name"),
    "library parent": (change(lambda m: m["custom_op_libraries"][0].update(file="../x.so")),
                       "custom_op_libraries.0.file: not a plain file name"),
    "files absolute": (change(lambda m: m["files"].update({"/etc/shadow": {"sha256": "0" * 64, "bytes": 1}})),
                       "files./etc/shadow.[key]: not a plain file name"),
}


@pytest.fixture(params=sorted(MANIFESTS))
def damaged(request, tmp_path):
    damage, message = MANIFESTS[request.param]
    bundle = copy_bundle("tabular", tmp_path)
    damage(bundle)
    return bundle, message


def test_load_refuses_a_damaged_manifest_naming_the_field(damaged):
    bundle, message = damaged
    with pytest.raises(BadInputError, match="re-run deploykit convert") as raised:
        deploykit.load(bundle, device="cpu")
    assert message in str(raised.value) and "\n" not in str(raised.value)


def assert_one_line_exit_2(result, message):
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr and "internal error" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("command", [["inspect"], ["run", "--device", "cpu"], ["doctor"], ["debug"]])
@pytest.mark.parametrize("case", ["validation passed", "no inputs", "huge shape", "json list", "library parent"])
def test_commands_refuse_a_damaged_manifest_with_exit_2(tmp_path, command, case):
    damage, message = MANIFESTS[case]
    bundle = copy_bundle("tabular", tmp_path)
    damage(bundle)
    assert_one_line_exit_2(run_deploykit(*command, bundle), message)


@pytest.mark.parametrize("command", [["bench"], ["profile"], ["validate", "--device", "cpu"]])
def test_timing_and_validate_refuse_a_damaged_manifest_with_exit_2(tmp_path, command):
    damage, message = MANIFESTS["validation passed"]
    bundle = copy_bundle("tabular", tmp_path)
    damage(bundle)
    model = ["model.pt", "--factory", "model_zoo:tabular"] if command[0] == "validate" else []
    (tmp_path / "model.pt").write_bytes(b"")
    assert_one_line_exit_2(run_deploykit(command[0], bundle, *model, *command[1:], cwd=tmp_path), message)


def test_an_intact_bundle_still_opens(tmp_path):
    bundle = copy_bundle("tabular", tmp_path)
    edit_manifest(bundle, lambda m: m.update(native=[{"file": "x"}], newer_key={"any": "thing"}))
    assert deploykit.load(bundle, device="cpu").inputs


# --------------------------------------------------------------------------- paths out of the bundle


def symlink_library_out(bundle, outside):
    """The op library replaced by a link to a file outside, whose sha256 the manifest then records."""
    target = outside / "libevil.so"
    target.write_bytes((bundle / "libdeploykit_ort.so").read_bytes())
    (bundle / "libdeploykit_ort.so").unlink()
    os.symlink(target, bundle / "libdeploykit_ort.so")
    edit_manifest(bundle, lambda m: m["files"]["libdeploykit_ort.so"].update(sha256=sha256_of(target)))


@pytest.fixture
def linked_out(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    bundle = copy_bundle("tabular", tmp_path)
    symlink_library_out(bundle, tmp_path / "elsewhere")
    return bundle


def test_load_refuses_a_symlink_out_of_the_bundle(linked_out):
    with pytest.raises(BadInputError, match="libdeploykit_ort.so leads outside the bundle"):
        deploykit.load(linked_out, device="cpu")


@pytest.mark.parametrize("command", [["run", "--device", "cpu"], ["debug"]])
def test_commands_refuse_a_symlink_out_of_the_bundle(linked_out, command):
    assert_one_line_exit_2(run_deploykit(*command, linked_out), "leads outside the bundle")


def test_inspect_and_doctor_report_a_symlink_out_without_following_it(linked_out):
    inspected = run_deploykit("inspect", linked_out, "--json")
    assert json.loads(inspected.stdout)["files"]["libdeploykit_ort.so"]["status"] == "outside the bundle"
    doctor = run_deploykit("doctor", linked_out)
    assert "outside the bundle" in doctor.stderr + doctor.stdout and "no problems found" not in doctor.stdout


def model_with_external_data(bundle, location):
    """model.onnx rewritten so that one initializer's data is read from ``location``."""
    model = onnx.load(bundle / "model.onnx")
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", location
    onnx.save(model, bundle / "model.onnx")
    edit_manifest(bundle, lambda m: m["files"]["model.onnx"].update(sha256=sha256_of(bundle / "model.onnx")))


@pytest.mark.parametrize("location", ["/etc/hostname", "../weights.bin"])
def test_external_data_outside_the_bundle_is_refused(tmp_path, location):
    bundle = copy_bundle("tabular", tmp_path)
    (tmp_path / "weights.bin").write_bytes(np.zeros(1024, np.float32).tobytes())
    model_with_external_data(bundle, location)
    with pytest.raises(BadInputError, match="reads external data from .*outside the bundle"):
        deploykit.load(bundle, device="cpu", op_library=False)
    assert_one_line_exit_2(run_deploykit("run", bundle, "--device", "cpu"), "outside the bundle")


def test_debug_on_a_graph_that_is_no_onnx_is_bad_input(tmp_path):
    bundle = copy_bundle("tabular", tmp_path)
    (bundle / "model.onnx").write_bytes(b"\xff" * 64)
    assert_one_line_exit_2(run_deploykit("debug", bundle), "model.onnx is not an ONNX graph")


# --------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("case, message", [
    ("empty file", "cannot read it as .npz"),
    ("npy", "holds a single array (.npy)"),
    ("no samples", "features holds no values (shape 0x13)"),
])
def test_unusable_inputs_are_bad_input(tmp_path, case, message):
    path = tmp_path / "inputs.npz"
    if case == "empty file":
        path.write_bytes(b"")
    elif case == "npy":
        with path.open("wb") as handle:
            np.save(handle, np.ones((1, 13), np.float32))
    else:
        np.savez(path, features=np.zeros((0, 13), np.float32))
    bundle = copy_bundle("tabular", tmp_path)
    assert_one_line_exit_2(run_deploykit("run", bundle, "--device", "cpu", "--inputs", path), message)


def test_random_inputs_too_large_for_memory_are_bad_input(tmp_path):
    bundle = copy_bundle("tabular", tmp_path)
    assert_one_line_exit_2(run_deploykit("run", bundle, "--device", "cpu", "--batch", str(10**12)),
                           "does not fit in this machine's memory")
