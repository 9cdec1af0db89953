"""``deploykit serve`` refuses bad options before it listens: one line each, exit 2."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("fastapi")

import converted_bundles  # noqa: E402
from deploykit_cli import run_deploykit  # noqa: E402


def test_bad_serve_options_exit_2(tmp_path):
    bundle = converted_bundles.converted("tabular")
    twin = shutil.copytree(bundle, tmp_path / "other" / bundle.name)
    empty = tmp_path / "token"
    empty.write_text("\n")
    cases = {
        ("--max-batch", "9"): "--max-batch 9 is outside tabular's batch range 1..4",
        ("--buckets", "1,x"): "--buckets '1,x': use auto, exact, validated or sizes like 1,4,16",
        ("--token-file", empty): "it must hold one token, without spaces",
        (twin,): "two bundles are named tabular",
        ("--device", "gpu"): "device 'gpu': use auto, cpu, cuda or cuda:N",
    }
    for args, message in cases.items():
        result = run_deploykit("serve", bundle, *args, "--port", "0", timeout=120)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)
