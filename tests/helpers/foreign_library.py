"""A shared library whose constructor writes a marker file, built with the C compiler at test time,
swapped into a copy of a bundle as its op library with the manifest's sha256 updated to match:
what a stranger's bundle can carry. The marker appears only if something loads the library. It
registers no op (ONNX Runtime then runs deploykit's ops as their ONNX functions), so a runtime
that loads it with consent runs the bundle and can say under which rule it loaded it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from converted_bundles import copy_bundle, edit_manifest
from deploykit.bundle.format import sha256_of

LIBRARY = "libdeploykit_ort.so"
SOURCE = """
#include <stdio.h>
__attribute__((constructor)) static void mark(void) {
    FILE *marker = fopen(MARKER, "w");
    if (marker) { fputs("loaded", marker); fclose(marker); }
}
void *RegisterCustomOps(void *options, const void *api) { return NULL; } /* NULL: an OrtStatus of success */
"""


def constructor_library(folder: Path, marker: Path) -> Path:
    """``folder/LIBRARY``, writing ``marker`` when it is loaded."""
    source = folder / "mark.c"
    source.write_text(SOURCE)
    library = folder / LIBRARY
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', str(source), "-o", str(library)], check=True)
    return library


def foreign_bundle(tmp_path: Path) -> tuple[Path, Path]:
    """(a tabular bundle carrying the constructor library as its op library, the marker path)."""
    bundle = copy_bundle("tabular", tmp_path)
    marker = tmp_path / "marker"
    built = constructor_library(tmp_path, marker)
    (bundle / LIBRARY).write_bytes(built.read_bytes())
    edit_manifest(bundle, lambda m: m["files"][LIBRARY].update(sha256=sha256_of(bundle / LIBRARY)))
    return bundle, marker
