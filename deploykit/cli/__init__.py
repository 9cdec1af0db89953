"""The ``deploykit`` command line: parse, call the API, print. No conversion logic here."""

from __future__ import annotations

import contextlib
import json
import sys
import time
import warnings
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from deploykit import errors
from deploykit.cli.debug import debug
from deploykit.cli.runtime import bench, doctor, inspect, profile, run, validate
from deploykit.specs import BatchRange, InputSpec

console = Console(stderr=True, highlight=False)


def _fail(message: str, code: int, verbose: bool, error: BaseException) -> None:
    if verbose:
        console.print_exception(show_locals=False)
    prefix = "internal error" if code == errors.EXIT_INTERNAL else "error"
    console.print(f"[bold red]{prefix}:[/] {message}", soft_wrap=True)
    sys.exit(code)


@contextlib.contextmanager
def _handle_errors(verbose: bool):
    if not verbose:  # torch's deprecation chatter is noise to a user converting a model
        warnings.simplefilter("ignore")
    try:
        yield
    except errors.DeployKitError as error:
        _fail(str(error), error.exit_code, verbose, error)
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]; nothing was written")
        sys.exit(errors.EXIT_INTERNAL)
    except Exception as error:  # anything unforeseen is our bug: say so, exit 4
        hint = "" if verbose else " (run with --verbose for the traceback)"
        _fail(f"{type(error).__name__}: {error}{hint}; please report it", errors.EXIT_INTERNAL, verbose, error)


def _stage_printer(quiet: bool):
    """A ``stage(title)`` context manager: a spinner while it runs, a timed line when done."""

    @contextlib.contextmanager
    def stage(title: str):
        start = time.perf_counter()
        if quiet:
            yield
            return
        with console.status(f"{title}..."):
            yield
        console.print(f"[green]✓[/] {title} [dim]({time.perf_counter() - start:.1f} s)[/]")

    return stage


def _parse(parser, values, option):
    try:
        return [parser(v) for v in values] if isinstance(values, tuple) else parser(values)
    except errors.BadInputError as error:
        raise click.BadParameter(str(error), param_hint=option) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="deploykit")
def main() -> None:
    """Turn a trained PyTorch model into a validated deployment bundle."""


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-o", "--output", "output", required=True, type=click.Path(path_type=Path),
              help="Bundle directory to create (written atomically).")
@click.option("--input", "inputs", multiple=True, metavar="NAME:SHAPE[:DTYPE]",
              help="A model input, e.g. x:1x3x224x224 (repeat for several).")
@click.option("--batch", metavar="MIN:OPT:MAX", help="Make dimension 0 of every input dynamic.")
@click.option("--factory", metavar="PKG.MODULE:FUNCTION",
              help="Build the model with this function and load MODEL as its state_dict.")
@click.option("--trust-pickle", is_flag=True,
              help="Allow a pickled nn.Module (unpickling runs code from the file).")
@click.option("--exporter", type=click.Choice(["auto", "dynamo", "torchscript"]), default="auto",
              show_default=True, help="auto: dynamo, or torchscript for TorchScript files.")
@click.option("--opset", type=int, default=18, show_default=True, help="ONNX opset to export.")
@click.option("--inputs", "feeds_path", type=click.Path(path_type=Path),
              help="Validate on these inputs (.npz named after the model inputs).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random validation inputs.")
@click.option("--tolerance", "tolerances", multiple=True, metavar="[OUTPUT:]KEY=VALUE,...",
              help="Override atol, rtol, min_cosine or min_top1, for all outputs or one.")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True,
              help="Write this precision into the graph; sensitive nodes stay fp32 (docs/precision.md).")
@click.option("--io-precision", type=click.Choice(["fp32", "fp16", "bf16"]),
              help="Type of the float inputs and outputs (default: as declared).")
@click.option("--auto-fix", is_flag=True, help="If validation fails, pin the nodes that diverge to fp32 and retry.")
@click.option("--no-custom-ops", is_flag=True,
              help="Write plain ONNX: no deploykit::FusedBatchNorm / MatMulRelu nodes.")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "all"]), default="onnxruntime",
              show_default=True, help="tensorrt/all also build a TensorRT engine (TensorRT or TensorRT-RTX).")
@click.option("--trt-targets", metavar="CC,CC", help="TensorRT-RTX compute capabilities, e.g. 8.6,8.9,12.0.")
@click.option("--trt-workspace", type=click.IntRange(min=1), metavar="MIB", help="TensorRT workspace limit in MiB.")
@click.option("--force", is_flag=True, help="Replace an existing bundle.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks and exporter logs.")
def convert(model, output, inputs, batch, factory, trust_pickle, exporter, opset, feeds_path, seed, tolerances,
            precision, io_precision, auto_fix, no_custom_ops, backend, trt_targets, trt_workspace, force, as_json, verbose):
    """Convert MODEL (TorchScript, .pt2, state_dict with --factory) into a validated bundle."""
    from deploykit.api import ConvertOptions, convert as run_convert  # heavy imports after parsing

    options = ConvertOptions(
        model=model, output=output, inputs=_parse(InputSpec.parse, inputs, "--input"),
        batch=_parse(BatchRange.parse, batch, "--batch") if batch else None,
        factory=factory, trust_pickle=trust_pickle, exporter=exporter, opset=opset,
        feeds_path=feeds_path, seed=seed, tolerances=list(tolerances), force=force,
        custom_ops=not no_custom_ops, backend=backend,
        precision=precision, io_precision=io_precision, auto_fix=auto_fix,
        trt_targets=[t.strip() for t in trt_targets.split(",")] if trt_targets else None,
        trt_workspace_bytes=trt_workspace << 20 if trt_workspace else None,
    )
    with _handle_errors(verbose):
        result = run_convert(options, stage=_stage_printer(quiet=as_json))
    if as_json:
        click.echo(json.dumps(result.report, indent=2))
    else:
        _print_summary(result)
    sys.exit(errors.EXIT_OK if result.passed else errors.EXIT_VALIDATION_FAILED)


def _print_summary(result) -> None:
    report = result.report
    graph = report["graph"]
    console.print(
        f"Graph: {graph['nodes_before']} → {graph['nodes_after']} nodes; BatchNorm: "
        f"{graph['batch_norm_in_model']} in PyTorch, {graph['batch_norm_before']} after the "
        f"{report['export']['exporter']} exporter (opset {report['export']['opset']}), "
        f"{graph['batch_norm_after']} after deploykit's passes"
    )
    custom = report["custom_ops"]
    if custom["ops"]:
        console.print(f"Custom ops: {', '.join(custom['ops'])}; {custom['note']}")
    for engine in report["engines"]:
        console.print(
            f"Engine: {engine['file']} ({engine['flavour']} {engine['version']}, targets "
            f"{', '.join(engine['targets'])}, {engine['plugin_layers']} deploykit plugin layers); {engine['note']}",
            soft_wrap=True,
        )
    for stats in report["passes"]:
        changes = ", ".join(f"{k} {v}" for k, v in stats["changes"].items() if v) or "no change"
        console.print(f"  {stats['name']}: {changes}")
    from deploykit.cli.debug import precision_lines
    for line in precision_lines(report):
        console.print(line, soft_wrap=True)
    final, *others = report["validation"]["candidates"]
    print_validation_table(final)
    for other in others:
        console.print(f"{other['label']} ({other['backend']}): {'pass' if other['passed'] else 'FAIL'}")
    print_notes_and_failures(report["notes"], report["failures"])
    colour = "green" if result.passed else "red"
    console.print(f"[bold {colour}]{report['verdict'].upper()}[/]: {report['summary']}")
    console.print(f"Bundle: {result.out_dir}")
    console.print(f"Report: {result.out_dir / 'report.html'}")


def print_validation_table(candidate: dict) -> None:
    """Per output and batch: the metrics and the verdict of one validated candidate."""
    table = Table(title=f"{candidate['label']} ({candidate['backend']}) vs PyTorch fp32", title_justify="left")
    for column in ("output", "batch", "max abs", "max rel", "cosine", "top-1", "verdict"):
        table.add_column(column, justify="left" if column == "output" else "right")
    for run in candidate["runs"]:
        for output in run["outputs"]:
            m = output["metrics"]
            top1 = m.get("top1_agreement")
            table.add_row(
                output["name"], str(run["batch"]),
                f"{m.get('max_abs', float('nan')):.3g}", f"{m.get('max_rel', float('nan')):.3g}",
                f"{m.get('cosine', float('nan')):.7f}", "" if top1 is None else f"{top1:.3f}",
                ("[green]pass*[/]" if output["waived"] else "[green]pass[/]") if output["passed"] else "[red]FAIL[/]",
            )
    console.print(table)


def print_notes_and_failures(notes: list[str], failures: list[str]) -> None:
    """Outputs that passed within fp32 rounding (*), then every failed check (✗)."""
    for line in notes:
        console.print(f"[yellow]*[/] {line}", soft_wrap=True)
    for line in failures:
        console.print(f"[red]✗[/] {line}", soft_wrap=True)


@main.command("build-plugins")
@click.option("--force", is_flag=True, help="Rebuild even if a cached build exists.")
@click.option("--cuda-archs", metavar="LIST", help='GPU architectures, e.g. "80;86;89;90;120" (default).')
@click.option("-v", "--verbose", is_flag=True, help="Show the CMake and compiler output.")
def build_plugins(force, cuda_archs, verbose):
    """Build deploykit's kernels, ONNX Runtime op library and TensorRT plugins (cached)."""
    from deploykit.native import build as native

    with _handle_errors(verbose):
        build = native.build_plugins(force=force, cuda_architectures=cuda_archs, verbose=verbose)
    for line in build.summary():
        console.print(line, soft_wrap=True)


for command in (run, validate, inspect, doctor, bench, profile, debug):
    main.add_command(command)
