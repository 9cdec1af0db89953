"""Unit tests of ``deploykit.bundle.write``: staged writes, the manifest, and safe replacement.

A bundle is written into a ``.NAME.*.partial`` sibling and renamed into place only when the
body succeeds; a failing body leaves nothing behind, an existing bundle is kept unless
``force`` is given, and even then it is replaced only after the new one is complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from deploykit.bundle.format import FORMAT, MANIFEST
from deploykit.bundle.read import read_manifest
from deploykit.bundle.write import check_destination, staged_bundle
from deploykit.errors import BadInputError

#: A file and its known sha256 (FIPS 180-2 test vector for b"abc").
ABC_SHA256 = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


class BodyFailed(Exception):
    """Raised inside a bundle body to simulate a failed conversion."""


def leftovers(parent: Path) -> list[str]:
    """Staging (``.*.partial``) and retired (``.*.old``) directories beside a bundle."""
    return sorted(path.name for pattern in (".*.partial", ".*.old") for path in parent.glob(pattern))


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` with its contents, to compare before and after."""
    return {str(path.relative_to(directory)): path.read_bytes()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def write_bundle(out_dir: Path, force: bool = False, files: dict[str, bytes] | None = None,
                 **manifest_fields) -> Path:
    """Publish a bundle holding ``files`` and a manifest with deploykit's format tag and ``manifest_fields``."""
    with staged_bundle(out_dir, force) as (staging, manifest):
        for name, data in (files or {"model.onnx": b"abc"}).items():
            (staging / name).write_bytes(data)
        manifest.update({"format": FORMAT, **manifest_fields})
    return out_dir


def write_failing_bundle(out_dir: Path, force: bool) -> None:
    """Start a bundle, write a file into it, then fail; the failure must propagate."""
    with pytest.raises(BodyFailed, match="conversion broke"):
        with staged_bundle(out_dir, force) as (staging, manifest):
            (staging / "model.onnx").write_bytes(b"half a model")
            manifest["model"] = "broken"
            raise BodyFailed("conversion broke")


# --- a successful run ---------------------------------------------------------------------

def test_published_bundle_has_files_and_a_manifest_with_hashes_and_sizes(tmp_path):
    out_dir = write_bundle(
        tmp_path / "bundle",
        files={"model.onnx": b"abc", "report.json": b"", "weights.bin": bytes(range(256)) * 4},
        model="tiny", precision="fp32",
    )
    assert sorted(path.name for path in out_dir.iterdir()) == [
        MANIFEST, "model.onnx", "report.json", "weights.bin"]
    manifest = read_manifest(out_dir)
    assert manifest == json.loads((out_dir / MANIFEST).read_text())
    assert manifest["model"] == "tiny" and manifest["precision"] == "fp32"
    assert manifest["files"]["model.onnx"] == {"sha256": ABC_SHA256, "bytes": 3}
    assert manifest["files"]["report.json"] == {"sha256": EMPTY_SHA256, "bytes": 0}
    assert manifest["files"]["weights.bin"]["bytes"] == 1024
    assert len(manifest["files"]["weights.bin"]["sha256"]) == 64
    assert MANIFEST not in manifest["files"]
    assert leftovers(tmp_path) == []


def test_relative_out_dir_is_published_where_asked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_bundle(Path("rel"))
    assert read_manifest(tmp_path / "rel")["files"]["model.onnx"]["sha256"] == ABC_SHA256
    assert leftovers(tmp_path) == []


# --- a failing body -----------------------------------------------------------------------

def test_failing_body_leaves_nothing_and_propagates(tmp_path):
    out_dir = tmp_path / "bundle"
    write_failing_bundle(out_dir, force=False)
    assert not out_dir.exists()
    assert leftovers(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_failing_body_with_force_keeps_the_old_bundle_intact(tmp_path):
    out_dir = write_bundle(tmp_path / "bundle", model="old")
    before = snapshot(out_dir)
    write_failing_bundle(out_dir, force=True)
    assert snapshot(out_dir) == before
    assert read_manifest(out_dir)["model"] == "old"
    assert leftovers(tmp_path) == []


# --- an existing destination --------------------------------------------------------------

def test_existing_out_dir_without_force_is_refused_before_the_body_runs(tmp_path):
    out_dir = tmp_path / "bundle"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("user data")
    body_ran = False
    with pytest.raises(BadInputError, match="already exists; pass --force"):
        with staged_bundle(out_dir, force=False):
            body_ran = True
    assert not body_ran
    assert snapshot(out_dir) == {"keep.txt": b"user data"}
    assert leftovers(tmp_path) == []


def test_forced_replace_publishes_the_new_bundle_and_removes_the_old(tmp_path):
    out_dir = write_bundle(tmp_path / "bundle", files={"model.onnx": b"old", "stale.txt": b"x"},
                           model="old")
    write_bundle(out_dir, force=True, model="new")
    assert sorted(path.name for path in out_dir.iterdir()) == [MANIFEST, "model.onnx"]
    manifest = read_manifest(out_dir)
    assert manifest["model"] == "new"
    assert manifest["files"] == {"model.onnx": {"sha256": ABC_SHA256, "bytes": 3}}
    assert leftovers(tmp_path) == []
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bundle"]


# --- check_destination and read_manifest --------------------------------------------------

def test_check_destination_accepts_a_new_directory_in_an_existing_parent(tmp_path):
    check_destination(tmp_path / "bundle", force=False)
    assert not (tmp_path / "bundle").exists()


@pytest.mark.parametrize("force", [False, True])
def test_check_destination_rejects_a_missing_parent(tmp_path, force):
    missing = tmp_path / "no" / "such"
    with pytest.raises(BadInputError, match="does not exist; create it"):
        check_destination(missing / "bundle", force)
    with pytest.raises(BadInputError):
        write_bundle(missing / "bundle", force)
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("force, message", [
    (False, "already exists"),
    (True, "exists and is not a directory"),
])
def test_check_destination_rejects_an_existing_regular_file(tmp_path, force, message):
    target = tmp_path / "bundle"
    target.write_text("not a bundle")
    with pytest.raises(BadInputError, match=message):
        check_destination(target, force)
    with pytest.raises(BadInputError, match=message):
        write_bundle(target, force)
    assert target.read_text() == "not a bundle"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("make", [
    lambda path: path.mkdir(),
    lambda path: None,
], ids=["empty-dir", "missing"])
def test_read_manifest_on_a_non_bundle_points_to_convert(tmp_path, make):
    target = tmp_path / "not_a_bundle"
    make(target)
    with pytest.raises(BadInputError, match="not a deploykit bundle") as raised:
        read_manifest(target)
    assert "deploykit convert" in str(raised.value)
    assert str(target) in str(raised.value)


def test_published_bundle_is_readable_by_others_per_umask(tmp_path):
    """mkdtemp makes a private directory; the bundle must get the usual umask-based mode."""
    previous = os.umask(0o022)
    try:
        write_bundle(tmp_path / "bundle")
    finally:
        os.umask(previous)
    assert (tmp_path / "bundle").stat().st_mode & 0o777 == 0o755
