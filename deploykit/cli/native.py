"""``deploykit build-plugins`` and ``build-runtime``: build the native libraries (deploykit.native.build) or
``deploykit-run`` (deploykit.native.runtime_build), print what was built."""

from __future__ import annotations

import click

from deploykit.cli._common import console, echo_json, handle_errors, json_option, verbose_option


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


@click.command("build-runtime")
@click.option("--with-libtorch", is_flag=True,
              help="Also build the AOTInductor path against the torch wheel's libtorch (adds ~0.5 s to each start).")
@click.option("--without-tensorrt", is_flag=True, help="Leave the TensorRT path out even where its headers and CUDA are found.")
@click.option("--force", is_flag=True, help="Rebuild even if a cached build exists.")
@click.option("--print-path", is_flag=True, help="Print only the path of deploykit-run on stdout.")
@json_option("Print the build (path, backends, notes) as JSON on stdout.")
@verbose_option("Show the CMake and compiler output.")
def build_runtime(with_libtorch, without_tensorrt, force, print_path, as_json, verbose):
    """Build the C++ runtime deploykit-run (cached) and print where it is.

    Exits 3, naming what to install, when a toolchain piece is missing.
    """
    from deploykit.native import runtime_build

    with handle_errors(verbose):
        build = runtime_build.build_runtime(with_libtorch=with_libtorch, tensorrt=not without_tensorrt,
                                            force=force, verbose=verbose)
    if as_json:
        echo_json(build.to_json())
    elif print_path:
        click.echo(build.executable)
    else:
        for line in build.summary():
            console.print(line, soft_wrap=True, markup=False)
