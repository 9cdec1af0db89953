"""Every command that can load a bundle's native code refuses a foreign library (exit 2, one line
naming --trust-bundle) and never loads it; --trust-bundle loads it; inspect calls it foreign;
doctor reports it as a problem.

The commands run where deploykit cannot build its op library (an empty cache, no headers, a
compiler that fails), so a foreign library cannot be swapped for this machine's build.
"""

from __future__ import annotations

import json

import pytest

from deploykit.errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT
from deploykit_cli import run_deploykit
from foreign_library import LIBRARY, foreign_bundle

COMMANDS = {
    "run": ["run", "{bundle}", "--device", "cpu"],
    "validate": ["validate", "{bundle}", "model.pt", "--device", "cpu"],
    "bench": ["bench", "{bundle}", "--only", "ort-deploykit", "--device", "cpu", "--iterations", "1", "-o", "{out}"],
    "tune": ["tune", "{bundle}", "--device", "cpu", "--iterations", "1", "--warmup", "0"],
    "profile": ["profile", "{bundle}", "--only", "onnxruntime", "--device", "cpu", "--iterations", "1", "-o", "{out}"],
    "debug": ["debug", "{bundle}", "--layerwise"],
}


@pytest.fixture
def foreign(monkeypatch, tmp_path):
    """(foreign bundle, marker), and the commands' environment set up so they cannot build here."""
    made = foreign_bundle(tmp_path)  # converting the shared bundle needs the real cache: first
    monkeypatch.setenv("DEPLOYKIT_CACHE", str(tmp_path / "cache"))
    for variable in ("ORT_ROOT", "TENSORRT_ROOT"):
        monkeypatch.setenv(variable, str(tmp_path / "nowhere"))
    for variable in ("CC", "CXX"):
        monkeypatch.setenv(variable, "/bin/false")
    return made


def _command(name: str, bundle, tmp_path, *extra) -> list[str]:
    return [part.format(bundle=bundle, out=tmp_path / "out") for part in COMMANDS[name]] + list(extra)


@pytest.mark.parametrize("name", COMMANDS)
def test_foreign_library_refused(name, tmp_path, foreign):
    bundle, marker = foreign
    result = run_deploykit(*_command(name, bundle, tmp_path), columns=400)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    assert f"{LIBRARY} is native code this machine's deploykit did not build" in result.stderr
    assert "--trust-bundle" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()


def test_trust_bundle_loads_it(tmp_path, foreign):
    bundle, marker = foreign
    run_deploykit(*_command("run", bundle, tmp_path, "--trust-bundle"))
    assert marker.read_text() == "loaded"


def _doctor_on_library(bundle, *options) -> tuple[int, dict]:
    """(doctor's exit code, its check of the bundle's op library)."""
    result = run_deploykit("doctor", bundle, "--json", *options)
    checks = json.loads(result.stdout)["checks"]
    [check] = [c for c in checks if c["area"] == "bundle native code" and c["detail"].startswith(LIBRARY)]
    return result.returncode, check


def test_doctor_fails_a_library_nothing_replaces(foreign):
    """Doctor does not refuse (as loaders do): it says why the bundle will not load, and the ways out."""
    bundle, marker = foreign
    code, check = _doctor_on_library(bundle)
    assert code == EXIT_ENVIRONMENT and check["status"] == "fail" and not marker.exists()
    assert "foreign" in check["detail"] and "nothing here replaces it, so deploykit refuses it" in check["detail"]
    assert "--trust-bundle loads it" in check["fix"] and "--no-op-library" in check["fix"]


def test_doctor_trust_bundle_loads_it_by_consent(foreign):
    bundle, marker = foreign
    _, check = _doctor_on_library(bundle, "--trust-bundle")
    assert check["status"] == "ok" and "foreign, trusted by consent (--trust-bundle)" in check["detail"]
    assert marker.read_text() == "loaded"


def test_doctor_names_this_machines_build_used_instead(tmp_path):
    bundle, marker = foreign_bundle(tmp_path)
    _, check = _doctor_on_library(bundle)
    assert check["status"] == "warn" and not marker.exists()
    assert "foreign" in check["detail"] and "deploykit uses this machine's build" in check["detail"]
    assert "--trust-bundle loads it" in check["fix"]


def test_inspect_calls_it_foreign(tmp_path):
    bundle, marker = foreign_bundle(tmp_path)
    result = run_deploykit("inspect", bundle, columns=400)
    assert result.returncode == 0, result.stderr
    assert f"native {LIBRARY} (onnxruntime-op-library): foreign; needs --trust-bundle" in result.stderr
    assert not marker.exists()
