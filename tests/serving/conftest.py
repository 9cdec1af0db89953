"""The bundle most serving tests serve: model_zoo's tabular net (13 features, two outputs, batch 1..4),
converted once per test module, and what ``deploykit.load`` answers for it (what a server must return)."""

from __future__ import annotations

import converted_bundles
import pytest


@pytest.fixture(scope="module")
def bundle():
    return converted_bundles.converted("tabular")


@pytest.fixture(scope="module")
def reference(bundle):
    import deploykit

    return deploykit.load(bundle, device="cpu").run
