"""``deploykit convert -o`` through the CLI: ``--force`` never replaces user data, a bad ``-o`` is
refused before any work, SIGTERM and SIGINT exit 130 leaving nothing, a full disk is exit 3."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deploykit.cli._common import handle_errors

import model_zoo
import mounts
from deploykit_cli import HELPERS, run_deploykit

ARGS = ("--factory", "model_zoo:tabular", "--input", "features:1x13")


@pytest.fixture
def weights(tmp_path) -> Path:
    path = tmp_path / "tabular.pt"
    torch.save(model_zoo.tabular().state_dict(), path)
    return path


def convert(cwd: Path, weights: Path, out, *extra) -> subprocess.CompletedProcess:
    return run_deploykit("convert", weights, *ARGS, "-o", out, *extra, cwd=cwd, columns=200, timeout=600)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_refused_before_work(result: subprocess.CompletedProcess, code: int, *words: str) -> None:
    report = f"exit {result.returncode}\nstderr:\n{result.stderr}"
    assert result.returncode == code, report
    assert "✓" not in result.stderr, f"a stage ran before the refusal\n{report}"
    assert "Traceback" not in result.stderr, report
    for word in words:
        assert word in result.stderr, f"{word!r} missing\n{report}"


def hidden(parent: Path) -> list[str]:
    return sorted(path.name for path in parent.iterdir() if path.name.startswith("."))


# --- --force ------------------------------------------------------------------------------

def test_force_over_a_project_folder_is_refused_and_keeps_every_file(tmp_path, weights):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.py").write_text("print('precious')")
    before = snapshot(project)
    result = convert(tmp_path, weights, project, "--force")
    assert_refused_before_work(result, 2, "error:", "neither a deploykit bundle nor empty", "choose another -o")
    assert snapshot(project) == before
    assert hidden(tmp_path) == []


def test_force_over_the_current_folder_with_files_is_refused(tmp_path, weights):
    (tmp_path / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    result = convert(tmp_path, weights, ".", "--force")
    assert_refused_before_work(result, 2, "neither a deploykit bundle nor empty")
    assert snapshot(tmp_path) == before


def test_force_over_a_file_is_refused(tmp_path, weights):
    (tmp_path / "out").write_text("a file")
    result = convert(tmp_path, weights, tmp_path / "out", "--force")
    assert_refused_before_work(result, 2, "exists and is not a directory")
    assert (tmp_path / "out").read_text() == "a file"


def test_force_over_an_empty_folder_and_then_over_the_bundle_works(tmp_path, weights):
    out = tmp_path / "out"
    out.mkdir()
    for _ in range(2):
        result = convert(tmp_path, weights, out, "--force")
        assert result.returncode == 0, result.stderr
        assert (out / "manifest.json").is_file()
    assert hidden(tmp_path) == []


# --- a bad -o -----------------------------------------------------------------------------

@pytest.mark.parametrize("out, words", [
    ("/proc/deploykit-out", ("cannot write in /proc", "choose another -o")),
    ("file.txt/sub", ("file.txt is not a directory", "choose another -o")),
], ids=["proc", "under-a-file"])
def test_an_impossible_output_is_refused_before_any_work(tmp_path, weights, out, words):
    (tmp_path / "file.txt").write_text("x")
    assert_refused_before_work(convert(tmp_path, weights, out), 2, "error:", *words)


def test_a_read_only_parent_is_refused_before_any_work(tmp_path, weights):
    with mounts.tmpfs(tmp_path / "ro", "ro") as read_only:
        result = convert(tmp_path, weights, read_only / "bundle")
    assert_refused_before_work(result, 2, "error:", "cannot write in", "Read-only file system")


def test_a_full_disk_is_exit_3_and_leaves_nothing(tmp_path, weights):
    with mounts.tmpfs(tmp_path / "tiny", "size=8k") as tiny:
        result = convert(tmp_path, weights, tiny / "bundle")
        left = sorted(path.name for path in tiny.iterdir())
    assert result.returncode == 3, result.stderr
    assert "is full" in result.stderr and "MiB of the bundle" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert left == []


# --- signals ------------------------------------------------------------------------------

@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_convert_exits_130_and_leaves_nothing(tmp_path, weights, signum):
    out = tmp_path / "out"
    # a shell starts background jobs (as CI may run us) with SIGINT ignored, which the child would
    # inherit: give it the default disposition a foreground command has
    child = subprocess.Popen([sys.executable, "-m", "deploykit", "convert", weights, *ARGS, "-o", out],
                             cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(HELPERS), "COLUMNS": "200"},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first_stage = child.stderr.readline()  # a stage has finished: the conversion is under way
    child.send_signal(signum)
    rest = child.stderr.read()
    assert child.wait(timeout=120) == 130, first_stage + rest
    assert "✓" in first_stage, first_stage
    assert "interrupted" in rest and "Traceback" not in rest, rest
    assert not out.exists()
    assert hidden(tmp_path) == []


def test_sigterm_in_any_command_exits_130_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
        with handle_errors(verbose=False):
            os.kill(os.getpid(), signal.SIGTERM)
    assert exited.value.code == 130
    assert signal.getsignal(signal.SIGTERM) is before
