"""``deploykit run | validate``: a bundle run as deploykit.load runs it here; parse, call, print. No logic here."""

from __future__ import annotations

import time
from pathlib import Path

import click

from deploykit.cli._common import (
    BUNDLE, allow_failed_option, combine, console, echo_json, exit_with_verdict, handle_errors, inputs_option,
    json_option, model_loading_options, seed_option, tolerance_option, trust_bundle_option, verbose_option,
)
from deploykit.cli._printing import VERDICT_COLOURS, print_notes, print_notes_and_failures, print_validation_table

#: --backend, --device, --allow-failed, --no-op-library and --trust-bundle: how deploykit.load runs the bundle.
_runtime_options = combine(
    click.option("--backend", type=click.Choice(["auto", "onnxruntime", "tensorrt", "aoti", "openvino"]),
                 default="auto", show_default=True, help="auto: the tuned choice, else the TensorRT engine where this "
                 "GPU runs it, else on a CPU the OpenVINO model where OpenVINO is installed, else ONNX Runtime; aoti: "
                 "the bundle's AOTInductor packages."),
    click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda[:N]", help="Where to run."),
    allow_failed_option("Run a bundle whose validation failed."),
    click.option("--no-op-library", is_flag=True,
                 help="Do not load libdeploykit_ort.so: deploykit ops run as their ONNX functions."),
    trust_bundle_option,
)


# --------------------------------------------------------------------------- run


@click.command("run")
@click.argument("bundle", type=BUNDLE)
@inputs_option("Inputs as .npz, named after the model inputs (default: seeded random inputs).")
@click.option("-o", "--output", type=click.Path(path_type=Path, dir_okay=False), help="Write the outputs to this .npz.")
@click.option("--batch", type=click.IntRange(min=1), help="Batch size of the random inputs (default: the optimum).")
@seed_option()
@_runtime_options
@click.option("--allow-unvalidated", is_flag=True,
              help="Run a batch outside the range the bundle was validated for (ONNX Runtime); the notes say so.")
@json_option("Print what ran and the outputs' statistics as JSON.")
@verbose_option()
def run(bundle, feeds_path, output, batch, seed, backend, device, allow_failed, no_op_library, allow_unvalidated,
        trust_bundle, as_json, verbose):
    """Run BUNDLE on --inputs (or random inputs) and write its outputs with -o.

    Arrays in --inputs are cast to the bundle's dtypes only where no value changes.
    """
    import numpy as np

    from deploykit import runtime

    with handle_errors(verbose):
        runner = runtime.load(bundle, backend, device, allow_failed=allow_failed, op_library=not no_op_library,
                              allow_unvalidated=allow_unvalidated, trust_native=trust_bundle)
        feeds = runtime.bundle_feeds(runner.inputs, feeds_path, batch, seed)
        start = time.perf_counter()
        outputs = runner.run(feeds)
        seconds = time.perf_counter() - start
        if output is not None:
            np.savez(output, **outputs)
    summary = {**runner.describe(), "seconds": seconds, "inputs": str(feeds_path) if feeds_path else f"random (seed {seed})",
               "outputs": {name: _stats(value) for name, value in outputs.items()},
               "written": str(output) if output else None}
    if as_json:
        echo_json(summary)
        return
    print_notes(runner.notes)
    _print_run(summary)


def _stats(array) -> dict:
    import numpy as np

    values = np.asarray(array)
    numeric = values.astype(np.float64) if values.size else np.zeros(1)
    return {"shape": list(values.shape), "dtype": str(values.dtype), "min": float(numeric.min()),
            "max": float(numeric.max()), "mean": float(numeric.mean())}


def _print_run(summary: dict) -> None:
    from rich.table import Table

    where = summary.get("provider") or summary.get("tensorrt") or ""
    console.print(f"Ran {summary['bundle']} with {summary['backend']} ({where}, {summary['device']}) on "
                  f"{summary['inputs']} in {summary['seconds'] * 1e3:.1f} ms", soft_wrap=True)
    table = Table(title="outputs", title_justify="left")
    for column in ("output", "shape", "dtype", "min", "max", "mean"):
        table.add_column(column, justify="left" if column in ("output", "dtype") else "right")
    for name, s in summary["outputs"].items():
        table.add_row(name, "x".join(map(str, s["shape"])), s["dtype"], f"{s['min']:.4g}", f"{s['max']:.4g}",
                      f"{s['mean']:.4g}")
    console.print(table)
    if summary["written"]:
        console.print(f"Outputs: {summary['written']}")


# --------------------------------------------------------------------------- validate


@click.command("validate")
@click.argument("bundle", type=BUNDLE)
@click.argument("model", type=click.Path(path_type=Path, dir_okay=False))
@model_loading_options
@inputs_option("Validate on these inputs (.npz named after the model inputs).")
@click.option("--batch", "batches", type=click.IntRange(min=1), multiple=True,
              help="Batch size of the random inputs; repeat for several (default: the bundle's min, opt and max).")
@seed_option()
@tolerance_option
@_runtime_options
@json_option("Print the comparison as JSON on stdout.")
@verbose_option()
def validate(bundle, model, factory, trust_pickle, feeds_path, batches, seed, tolerances, backend, device,
             allow_failed, no_op_library, trust_bundle, as_json, verbose):
    """Compare BUNDLE, run here as it will be deployed, with MODEL in PyTorch (fp32, CPU).

    Conversion validated on the converting machine; this checks the bundle on this machine's
    backend (the CUDA provider or TensorRT engine on a GPU) and on your data. The bundle is only
    read. Exit code 1 when an output fails, 5 when every output passes but one does not depend on
    the inputs (the comparison proves nothing for it).
    """
    from deploykit.validation.bundle import validate_bundle

    with handle_errors(verbose):
        result = validate_bundle(bundle, model, factory=factory, trust_pickle=trust_pickle, feeds_path=feeds_path,
                                 batches=list(batches), seed=seed, tolerances=tolerances, backend=backend,
                                 device=device, allow_failed=allow_failed, op_library=not no_op_library,
                                 trust_native=trust_bundle)
    summary = result.to_json()
    if as_json:
        echo_json(summary)
    else:
        print_notes(result.runner.notes)
        print_validation_table(summary["validation"])
        print_notes_and_failures(result.validation.rounding_notes(), summary["failures"], summary["inconclusive"])
        colour = VERDICT_COLOURS[result.verdict]
        console.print(f"[bold {colour}]{result.verdict.upper()}[/]: {summary['bundle']} on {result.runner.name} "
                      f"against {model} ({summary['inputs']})", soft_wrap=True)
    exit_with_verdict(result.verdict)
