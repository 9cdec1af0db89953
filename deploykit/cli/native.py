"""``deploykit build-plugins``: build the native libraries with deploykit.native.build, print what was built."""

from __future__ import annotations

import click

from deploykit.cli._common import console, handle_errors, verbose_option


@click.command("build-plugins")
@click.option("--force", is_flag=True, help="Rebuild even if a cached build exists.")
@click.option("--cuda-archs", metavar="LIST", help='GPU architectures, e.g. "80;86;89;90;120" (default).')
@verbose_option("Show the CMake and compiler output.")
def build_plugins(force, cuda_archs, verbose):
    """Build deploykit's kernels, ONNX Runtime op library and TensorRT plugins (cached)."""
    from deploykit.native import build as native_build

    with handle_errors(verbose):
        build = native_build.build_plugins(force=force, cuda_architectures=cuda_archs, verbose=verbose)
    for line in build.summary():
        console.print(line, soft_wrap=True)
