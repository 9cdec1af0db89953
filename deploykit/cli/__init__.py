"""The ``deploykit`` command line: parse, call the API, print. No conversion logic here.

One module per command group: ``convert``, ``runtime`` (run, validate), ``inspect``, ``doctor``,
``timing`` (bench, tune, profile), ``debug``, ``native`` (build-plugins, build-runtime) and ``serve`` (serve,
export triton); ``_common`` holds what they
share (console, error handling and exit codes, options) and ``_printing`` the output several print.
Heavy modules are imported inside the commands so that ``deploykit --help`` stays fast.
"""

from __future__ import annotations

import click

from deploykit.cli import convert, debug, doctor, inspect, native, runtime, serve, timing


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="deploykit")
def main() -> None:
    """Turn a trained PyTorch model into a validated deployment bundle."""


for command in (convert.convert, native.build_plugins, native.build_runtime, runtime.run, runtime.validate,
                inspect.inspect, doctor.doctor, timing.bench, timing.tune, timing.profile, debug.debug, serve.serve, serve.export):
    main.add_command(command)
