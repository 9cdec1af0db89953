"""Publishing a bundle never loses data: what ``--force`` may replace, an atomic swap, what an
interrupted run leaves (and the next run cleans), a destination checked before any work; and the
same for the result files bench, profile and tune write into a folder (``replace_files``).

A run is killed at a known step of the publish through ``write.checkpoint`` in a child process
(SIGKILL: no cleanup runs), or interrupted in this process by a checkpoint that raises.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deploykit.bundle import write
from deploykit.bundle.format import FORMAT, MANIFEST
from deploykit.errors import BadInputError, EnvironmentProblem

import mounts

CHILD = textwrap.dedent('''
    import os, signal, sys
    from pathlib import Path
    from deploykit.bundle import write

    out_dir, kill_at, fallback = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "fallback"
    if fallback:
        write.exchange = lambda first, second: False
    write.checkpoint = lambda step: step == kill_at and os.kill(os.getpid(), signal.SIGKILL)
    with write.staged_bundle(out_dir, force=True) as (staging, manifest):
        (staging / "model.onnx").write_bytes(b"new")
        manifest.update({"format": "deploykit-bundle", "model": "new"})
''')


def publish(out_dir: Path, model: str, force: bool = True) -> Path:
    with write.staged_bundle(out_dir, force) as (staging, manifest):
        (staging / "model.onnx").write_bytes(model.encode())
        manifest.update({"format": FORMAT, "model": model})
    return out_dir


def model_of(out_dir: Path) -> str:
    """Which complete bundle OUT holds: its manifest's model, checked against its file."""
    model = json.loads((out_dir / MANIFEST).read_text())["model"]
    assert (out_dir / "model.onnx").read_bytes() == model.encode()
    return model


def leftovers(parent: Path) -> list[str]:
    return sorted(path.name for path in parent.iterdir() if path.name.startswith("."))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def killed_publish(out_dir: Path, step: str, mode: str) -> None:
    result = subprocess.run([sys.executable, "-c", CHILD, str(out_dir), step, mode], capture_output=True, text=True)
    assert result.returncode == -signal.SIGKILL, result.stderr


# --- what --force may replace -------------------------------------------------------------

@pytest.mark.parametrize("files", [
    {"src/main.py": b"print('precious')", "README.md": b"# project"},
    {"manifest.json": b'{"format": "something-else"}', "data.csv": b"1,2"},
    {"manifest.json": b"not json", "notes.txt": b"x"},
], ids=["project-folder", "foreign-manifest", "broken-manifest"])
def test_force_refuses_a_directory_that_is_not_a_bundle(tmp_path, files):
    out_dir = tmp_path / "project"
    for name, data in files.items():
        (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_bytes(data)
    before = snapshot(out_dir)
    with pytest.raises(BadInputError, match="neither a deploykit bundle nor empty; --force replaces only"):
        publish(out_dir, "new")
    assert snapshot(out_dir) == before
    assert leftovers(tmp_path) == []


def test_force_replaces_an_empty_directory(tmp_path):
    (tmp_path / "bundle").mkdir()
    assert model_of(publish(tmp_path / "bundle", "new")) == "new"
    assert leftovers(tmp_path) == []


# --- an atomic swap -----------------------------------------------------------------------

def test_exchange_swaps_two_directories(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("a")
    (tmp_path / "b").mkdir()
    assert write.exchange(tmp_path / "a", tmp_path / "b")  # Linux: renameat2 is there
    assert (tmp_path / "b" / "f").read_text() == "a" and not any((tmp_path / "a").iterdir())


@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_an_interrupted_publish_keeps_out_complete_and_cleans_up(tmp_path, monkeypatch, mode):
    out_dir = publish(tmp_path / "bundle", "old")
    if mode == "fallback":
        monkeypatch.setattr(write, "exchange", lambda first, second: False)
    step = {"exchange": "exchanged", "fallback": "retired"}[mode]

    def interrupt(reached):
        if reached == step:
            raise KeyboardInterrupt

    monkeypatch.setattr(write, "checkpoint", interrupt)
    with pytest.raises(KeyboardInterrupt):
        publish(out_dir, "new")
    assert model_of(out_dir) == "new"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("mode, step, left", [
    ("exchange", "staged", "old"),
    ("exchange", "exchanged", "new"),
    ("fallback", "staged", "old"),
    ("fallback", "retired", None),  # OUT missing until the next run finishes the swap
    ("fallback", "published", "new"),
])
def test_a_killed_publish_is_finished_or_cleaned_by_the_next_run(tmp_path, mode, step, left):
    out_dir = publish(tmp_path / "bundle", "old")
    killed_publish(out_dir, step, mode)
    assert leftovers(tmp_path), "a killed run leaves its directories"
    if left is None:
        assert not out_dir.exists()
    else:
        assert model_of(out_dir) == left
    write.prepare_destination(out_dir, force=True)
    assert model_of(out_dir) == (left or "new")
    assert leftovers(tmp_path) == []


def test_a_live_runs_staging_is_not_cleaned(tmp_path):
    out_dir = publish(tmp_path / "bundle", "old")
    live, abandoned = tmp_path / ".bundle.live.partial", tmp_path / ".bundle.dead.partial"
    live.mkdir()
    (live / "model.onnx").write_bytes(b"being written")
    abandoned.mkdir()
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        publish(out_dir, "new")
        assert (live / "model.onnx").read_bytes() == b"being written"
        assert not abandoned.exists()
    finally:
        os.close(fd)
    assert model_of(out_dir) == "new"
    assert leftovers(tmp_path) == [live.name]


# --- a destination checked before any work, and a full disk -------------------------------

@pytest.mark.parametrize("target, message", [
    (lambda tmp: Path("/proc/deploykit-out"), "cannot write in /proc"),
    (lambda tmp: tmp / "file.txt" / "sub", "file.txt is not a directory"),
], ids=["proc", "under-a-file"])
def test_an_impossible_destination_is_refused(tmp_path, target, message):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(BadInputError, match=message):
        write.check_destination(target(tmp_path), force=True)


def test_a_read_only_parent_is_refused(read_only_dir):
    with pytest.raises(BadInputError, match=f"cannot write in {read_only_dir} .*Read-only file system"):
        write.check_destination(read_only_dir / "bundle", force=False)


def test_a_full_disk_is_an_environment_problem_and_leaves_nothing(tmp_path):
    with pytest.raises(EnvironmentProblem, match=r"is full .* after 0\.5 MiB of the bundle; free at least"):
        with write.staged_bundle(tmp_path / "bundle", force=False) as (staging, _manifest):
            (staging / "weights.bin").write_bytes(bytes(1 << 19))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert list(tmp_path.iterdir()) == []


def test_a_real_full_disk_is_an_environment_problem_and_leaves_nothing(tiny_disk):
    with pytest.raises(EnvironmentProblem, match="No space left on device"):
        with write.staged_bundle(tiny_disk / "bundle", force=False) as (staging, _manifest):
            (staging / "weights.bin").write_bytes(bytes(2 << 20))
    assert list(tiny_disk.iterdir()) == []


# --- result files written into a folder: checked first, then all or none --------------------

OLD = {"bench.json": b"old json", "bench.png": b"old png"}
NEW = {"bench.json": "new json", "bench.png": b"new png"}


@pytest.fixture
def results(tmp_path) -> Path:
    """A folder holding the results of an earlier run."""
    folder = tmp_path / "results"
    folder.mkdir()
    for name, data in OLD.items():
        (folder / name).write_bytes(data)
    return folder


def files_in(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.mark.parametrize("target, message", [
    (lambda tmp: Path("/proc/deploykit-out"), "cannot write in /proc .*; choose another -o"),
    (lambda tmp: tmp / "file.txt" / "sub", "file.txt is not a directory; choose another -o"),
], ids=["proc", "under-a-file"])
def test_an_impossible_results_folder_is_refused(tmp_path, target, message):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(BadInputError, match=message):
        write.check_results_folder(target(tmp_path))


def test_a_results_folder_is_probed_without_being_made(tmp_path, results):
    write.check_results_folder(tmp_path / "new" / "folder")
    write.check_results_folder(results)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["results"] and files_in(results) == OLD


def test_results_in_a_read_only_folder_are_refused(read_only_dir):
    with pytest.raises(BadInputError, match=f"cannot write in {read_only_dir} .*Read-only file system"):
        write.check_results_folder(read_only_dir / "results")


def test_results_replace_the_old_ones_and_are_named_as_they_land(tmp_path, results):
    written = []
    write.replace_files(results, NEW, written)
    write.replace_files(tmp_path / "new" / "folder", NEW)
    expected = {name: data if isinstance(data, bytes) else data.encode() for name, data in NEW.items()}
    assert files_in(results) == files_in(tmp_path / "new" / "folder") == expected
    assert written == [results / name for name in NEW]
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "new" / "folder" / "bench.png").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("room", [3, len("new json") + 3], ids=["in-the-first-file", "in-the-second-file"])
def test_a_full_disk_while_writing_results_is_exit_3_and_changes_nothing(results, monkeypatch, room):
    monkeypatch.setattr(write, "os", mounts.os_with(fdopen=mounts.filling_fdopen(room)))
    written = []
    with pytest.raises(EnvironmentProblem, match=r"the disk of .*results is full \(No space left on device\) writing "
                       r"bench.json, bench.png \(0.0 MiB\), so none of them was written; free that much") as full:
        write.replace_files(results, NEW, written)
    assert full.value.exit_code == 3 and files_in(results) == OLD and written == []


def test_an_interrupt_while_writing_results_changes_nothing(results, monkeypatch):
    monkeypatch.setattr(write, "os", mounts.os_with(fdopen=mounts.filling_fdopen(len("new json") + 3,
                                                                              KeyboardInterrupt())))
    written = []
    with pytest.raises(KeyboardInterrupt):
        write.replace_files(results, NEW, written)
    assert files_in(results) == OLD and written == []


@pytest.fixture
def sigint_interrupts():
    """SIGINT raises KeyboardInterrupt here, even where the shell started the tests with it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_signal_while_results_land_waits_until_all_of_them_have(results, monkeypatch, sigint_interrupts):
    def replace(source, target):
        os.kill(os.getpid(), signal.SIGINT)  # held while the files land: delivered once all are in place
        os.replace(source, target)

    monkeypatch.setattr(write, "os", mounts.os_with(replace=replace))
    written = []
    with pytest.raises(KeyboardInterrupt):
        write.replace_files(results, NEW, written)
    assert files_in(results) == {"bench.json": b"new json", "bench.png": b"new png"}
    assert written == [results / name for name in NEW]


@pytest.fixture
def read_only_dir(tmp_path):
    with mounts.tmpfs(tmp_path / "ro", "ro") as where:
        yield where


@pytest.fixture
def tiny_disk(tmp_path):
    with mounts.tmpfs(tmp_path / "tiny", "size=1m") as where:
        yield where
