"""``deploykit inspect BUNDLE``: parse, call deploykit.bundle.inspect, print. No logic here."""

from __future__ import annotations

import click

from deploykit import errors
from deploykit.cli._common import BUNDLE, console, echo_json, exit_with_verdict, handle_errors, json_option, verbose_option
from deploykit.cli._printing import print_tuning_table, skipped_text


@click.command("inspect")
@click.argument("bundle", type=BUNDLE)
@json_option("Print the summary as JSON.")
@verbose_option()
def inspect(bundle, as_json, verbose):
    """Show what BUNDLE holds (inputs, outputs, precision, ops, engines, AOTInductor packages, validation) and
    check its files.

    Reads manifest.json only: nothing is loaded or run. Exit code 1 when a file is missing or
    changed since conversion.
    """
    from deploykit.bundle.inspect import describe_bundle

    with handle_errors(verbose):
        info = describe_bundle(bundle)
    if as_json:
        echo_json(info)
    else:
        _print_info(info)
    exit_with_verdict(errors.verdict(info["files_ok"]))


def _print_info(info: dict) -> None:
    from rich.table import Table

    console.print(f"{info['bundle']}: {info['precision']} ONNX (opset {info['opset']}, IR {info['ir_version']}, "
                  f"{info['exporter']} exporter) from {info['source']}, {info['created']}", soft_wrap=True)
    table = Table(title="inputs and outputs", title_justify="left")
    for column in ("", "name", "dtype", "shape"):
        table.add_column(column)
    for kind in ("inputs", "outputs"):
        for tensor in info[kind]:
            table.add_row(kind[:-1], tensor["name"], tensor["dtype"], tensor["shape"])
    console.print(table)
    if info["custom_ops"]:
        console.print(f"deploykit ops: {', '.join(info['custom_ops'])} (ONNX Runtime library {info['op_library']}; "
                      "each has an ONNX function fallback)", soft_wrap=True)
    for engine in info["engines"]:
        console.print(f"engine: {engine['file']} ({engine['flavour']} {engine['version']}, "
                      f"targets {', '.join(engine['targets'] or [])}){skipped_text(engine)}", soft_wrap=True)
    for package in info["aoti"]:
        target = (f"compute capability {package['cuda_arch']} ({package['gpu']})" if package["device"] == "cuda"
                  else f"CPU ISA {package['cpu_isa'] or 'any'}")
        graph = ", CUDA graph" if package["cuda_graph"] else ""
        console.print(f"aoti: {package['file']} ({package['device']}, batch {package['batch']}, {package['precision']}, "
                      f"torch {package['torch']}, {target}{graph}; "
                      f"{'validated' if package['validated'] else 'NOT validated'})", soft_wrap=True)
    for model in info["openvino"]:
        made = f", NNCF {model['nncf']}" if model["nncf"] else ""
        console.print(f"openvino: {model['file']} ({model['precision']}, CPU, OpenVINO {model['openvino']}{made}; "
                      f"{'validated' if model['validated'] else 'NOT validated'})", soft_wrap=True)
    changed = [f"{name} ({', '.join(f'{k} {v}' for k, v in changes.items())})"
               for name, changes in info["passes"].items() if changes]
    console.print(f"passes: {'; '.join(changed) or 'none changed the exported graph'}", soft_wrap=True)
    validation = info["validation"]
    worst = ", ".join(f"{name} {value:.3g}" for name, value in validation.get("max_abs", {}).items())
    tolerances = " ".join(f"--tolerance {text}" for text in validation.get("tolerances", [])) or "the defaults"
    console.print(f"validation at conversion: {'passed' if validation.get('passed') else 'FAILED'} on "
                  f"{validation.get('backend')}, batch sizes {validation.get('batch_sizes')}, max abs {worst}; "
                  f"tolerances: {tolerances}", soft_wrap=True)
    for name, reason in validation.get("inconclusive", {}).items():  # the reason's first part: what, not the advice
        console.print(f"  [yellow]inconclusive[/] for output {name}: {reason.split('; ')[0]}", soft_wrap=True)
    if info["quantization"]:
        quantization, calibration = info["quantization"], info["quantization"]["calibration"]
        console.print(f"{info['precision']}: {len(quantization['quantized_nodes'])} nodes quantized, "
                      f"{len(quantization['float_nodes'])} float ({quantization['format']}); calibrated "
                      f"({quantization['calibration_method']}) on {calibration['samples']} samples of "
                      f"{calibration['source']}", soft_wrap=True)
    if info["tuning"]:
        print_tuning_table(info["tuning"])
    for native in info["native"]:
        needed = ("[bold yellow]needs --trust-bundle[/] (an op library is replaced by this machine's build where "
                  "deploykit can build one)") if native["needs_trust"] else "loads without --trust-bundle"
        console.print(f"native {native['file']} ({native['kind']}): {native['provenance']}; {needed}", soft_wrap=True)
    for name, entry in info["files"].items():
        status = "[green]ok[/]" if entry["status"] == "ok" else f"[bold red]{entry['status']}[/]"
        console.print(f"file {name}: {entry['bytes']} bytes, sha256 {status}")
