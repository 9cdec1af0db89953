"""Without the ``serve`` extra, ``deploykit serve`` says what to install (exit 3), never a traceback."""

from __future__ import annotations

import sys

import pytest

from deploykit.errors import EXIT_ENVIRONMENT, EnvironmentProblem
from deploykit.serving import server


def test_missing_extra_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(EnvironmentProblem) as error:
        server.require_serving_packages()
    assert str(error.value) == "deploykit serve needs uvicorn, prometheus-client: pip install 'deploykit[serve]'"
    assert error.value.exit_code == EXIT_ENVIRONMENT


def test_grpc_names_its_packages_only_when_asked(monkeypatch):
    monkeypatch.setitem(sys.modules, "grpc", None)
    monkeypatch.delitem(sys.modules, "tritonclient.grpc", raising=False)  # imported afresh: it needs grpcio
    server.require_serving_packages()  # HTTP alone needs no grpcio
    with pytest.raises(EnvironmentProblem) as error:  # tritonclient.grpc raises RuntimeError without grpcio
        server.require_serving_packages(grpc=True)
    assert str(error.value) == "deploykit serve needs grpcio, tritonclient[grpc]: pip install 'deploykit[serve]'"
