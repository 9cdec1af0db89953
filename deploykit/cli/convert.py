"""``deploykit convert MODEL -o BUNDLE``: parse, call deploykit.api.convert, print the report. No logic here."""

from __future__ import annotations

import collections
from pathlib import Path

import click

from deploykit.cli._common import (
    console, echo_json, exit_with_verdict, handle_errors, json_option, model_loading_options, parse_with,
    seed_option, stage_printer, tolerance_option, verbose_option,
)
from deploykit.cli._printing import (
    VERDICT_COLOURS, print_notes_and_failures, print_tuning_table, print_validation_table, round_lines, skipped_text,
    tradeoff_lines,
)

PRECISIONS = ["fp32", "fp16", "bf16"]
#: int8 and fp8 are precisions of the weights and activations only: inputs and outputs stay float.
MODEL_PRECISIONS = [*PRECISIONS, "int8", "fp8"]

#: fp32 nodes of a low-precision graph listed by name; report.json has the rest.
_LISTED_FP32_NODES = 8


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-o", "--output", "output", required=True, type=click.Path(path_type=Path),
              help="Bundle directory to create (written atomically).")
@click.option("--input", "inputs", multiple=True, metavar="NAME:SHAPE[:DTYPE]",
              help="A model input, e.g. x:1x3x224x224 (repeat for several).")
@click.option("--batch", metavar="MIN:OPT:MAX", help="Make dimension 0 of every input dynamic.")
@model_loading_options
@click.option("--exporter", type=click.Choice(["auto", "dynamo", "torchscript"]), default="auto",
              show_default=True, help="auto: dynamo, or torchscript for TorchScript files.")
@click.option("--opset", type=int, default=18, show_default=True, help="ONNX opset to export.")
@click.option("--inputs", "feeds_path", type=click.Path(path_type=Path),
              help="Validate on these inputs (.npz named after the model inputs; cast to the declared dtypes only "
                   "where no value changes).")
@seed_option("Seed of the random validation inputs.")
@tolerance_option
@click.option("--precision", type=click.Choice(MODEL_PRECISIONS), default="fp32", show_default=True,
              help="Write this precision into the graph; sensitive nodes stay fp32 (int8: ONNX Runtime's static "
                   "quantization on the CPU; fp8: the Linear layers' products in AOTInductor packages with --backend aoti, "
                   "float8 Q/DQ for an fp8 engine with --backend tensorrt; docs/precision.md).")
@click.option("--calibration", "calibration_path", type=click.Path(path_type=Path),
              help="int8, fp8: samples that fit the scales (.npz named after the model inputs, axis 0 = samples); "
                   "without it random inputs do, and the verdict is inconclusive.")
@click.option("--calibration-method", type=click.Choice(["minmax", "entropy", "percentile"]), default="minmax",
              show_default=True, help="int8: how the activation ranges are chosen from the calibration samples.")
@click.option("--io-precision", type=click.Choice(PRECISIONS),
              help="Type of the float inputs and outputs (default: as declared).")
@click.option("--auto-fix", is_flag=True, help="If validation fails, pin the nodes that diverge to fp32 and retry.")
@click.option("--no-custom-ops", is_flag=True,
              help="Write plain ONNX: no deploykit::FusedBatchNorm / MatMulRelu nodes.")
@click.option("--no-ort-fusions", is_flag=True,
              help="Leave attention, layer norms and Gelu unfused: no ONNX Runtime contrib ops in the graph.")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "aoti", "openvino", "all"]), default="onnxruntime",
              show_default=True, help="tensorrt/all also build a TensorRT engine (TensorRT or TensorRT-RTX); "
              "aoti/all also compile AOTInductor packages (all: on a GPU only; docs/aoti.md); openvino also builds an "
              "OpenVINO model for the CPU (fp32, or int8 by NNCF; pip install 'deploykit[openvino]').")
@click.option("--aoti-shapes", type=click.Choice(["dynamic", "static", "both"]), default="both", show_default=True,
              help="AOTInductor packages: one over the --batch range, one per validated batch size, or both.")
@click.option("--trt-targets", metavar="CC,CC", help="TensorRT-RTX compute capabilities, e.g. 8.6,8.9,12.0.")
@click.option("--trt-workspace", type=click.IntRange(min=1), metavar="MIB", help="TensorRT workspace limit in MiB.")
@click.option("--tune", is_flag=True, help="Then time every backend that runs the bundle here, check its outputs, and "
              "record the fastest per batch size for deploykit.load (docs/tuning.md).")
@click.option("--force", is_flag=True, help="Replace an existing bundle.")
@json_option("Print the report as JSON on stdout.")
@verbose_option("Show tracebacks and exporter logs.")
def convert(model, output, inputs, batch, factory, trust_pickle, exporter, opset, feeds_path, seed, tolerances,
            precision, calibration_path, calibration_method, io_precision, auto_fix, no_custom_ops, no_ort_fusions, backend, aoti_shapes, trt_targets,
            trt_workspace, tune, force, as_json, verbose):
    """Convert MODEL (TorchScript, .pt2, state_dict with --factory) into a validated bundle."""
    from deploykit.api import ConvertOptions, convert as run_convert  # heavy imports after parsing
    from deploykit.specs import BatchRange, InputSpec

    options = ConvertOptions(
        model=model, output=output, inputs=parse_with(InputSpec.parse, inputs, "--input"),
        batch=parse_with(BatchRange.parse, batch, "--batch") if batch else None,
        factory=factory, trust_pickle=trust_pickle, exporter=exporter, opset=opset,
        feeds_path=feeds_path, seed=seed, tolerances=list(tolerances), force=force,
        custom_ops=not no_custom_ops, ort_fusions=not no_ort_fusions, backend=backend, aoti_shapes=aoti_shapes,
        precision=precision, io_precision=io_precision, auto_fix=auto_fix, tune=tune,
        calibration_path=calibration_path, calibration_method=calibration_method,
        trt_targets=[t.strip() for t in trt_targets.split(",")] if trt_targets else None,
        trt_workspace_bytes=trt_workspace << 20 if trt_workspace else None,
    )
    with handle_errors(verbose):
        result = run_convert(options, stage=stage_printer(quiet=as_json))
    if as_json:
        echo_json(result.report)
    else:
        _print_summary(result)
    exit_with_verdict(result.report["verdict"])


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
    if fused := report["ort_fusions"]["ops"]:
        console.print(f"ONNX Runtime fused ops: {', '.join(f'{op} {n}' for op, n in fused.items())}")
    for engine in report["engines"]:
        console.print(
            f"Engine: {engine['file']} ({engine['flavour']} {engine['version']}, targets "
            f"{', '.join(engine['targets'])}, {engine['plugin_layers']} deploykit plugin layers){skipped_text(engine)}; "
            f"{engine['note']}",
            soft_wrap=True,
        )
    aoti = report.get("aoti")
    if aoti:
        console.print(f"AOTInductor: {aoti['note']}", soft_wrap=True)
    for stats in report["passes"]:
        changes = ", ".join(f"{k} {v}" for k, v in stats["changes"].items() if v) or "no change"
        console.print(f"  {stats['name']}: {changes}")
    for line in _precision_lines(report):
        console.print(line, soft_wrap=True)
    final, *others = report["validation"]["candidates"]
    print_validation_table(final)
    for other in others:
        console.print(f"{other['label']} ({other['backend']}): {'pass' if other['passed'] else 'FAIL'}")
    print_notes_and_failures(report["notes"], report["failures"], report["inconclusive"])
    if report.get("tuning"):
        print_tuning_table(report["tuning"])
    colour = VERDICT_COLOURS[report["verdict"]]
    console.print(f"[bold {colour}]{report['verdict'].upper()}[/]: {report['summary']}", soft_wrap=True)
    console.print(f"Bundle: {result.out_dir}")
    console.print(f"Report: {result.out_dir / 'report.html'}")


def _precision_lines(report: dict) -> list[str]:
    """What ``convert`` prints about the precision stage (nothing for fp32)."""
    info = report.get("precision") or {}
    if info.get("precision", "fp32") == "fp32":
        return []
    if info["precision"] in ("int8", "fp8"):  # fp8 for AOTInductor: the products in the packages, the rest an fp16 graph
        graph = _precision_lines({"precision": info["graph"]}) if "graph" in info else []
        return [*_quantized_lines(info), *graph]
    nodes, low = info["nodes"], info["precision"]
    lines = [f"Precision: {low} ({_count(nodes[low], 'node')} {low}, {nodes['fp32']} fp32, "
             f"{_count(info['casts'], 'cast')}); {info['execution']}"]
    quiet = ("on the fp32 side", "auto-fix:")  # cheap nodes, and pins listed below
    sensitive = [n for n in info["fp32_nodes"] if not n["reason"].startswith(quiet)]
    lines += [f"  fp32: {n['node']} ({n['op']}): {n['reason']}" for n in sensitive[:_LISTED_FP32_NODES]]
    if len(sensitive) > _LISTED_FP32_NODES:
        lines.append(f"  ... and {len(sensitive) - _LISTED_FP32_NODES} more (report.json lists them)")
    fix = info.get("auto_fix")
    if fix:
        lines += ["  auto-fix " + line for line in round_lines(fix.get("round_log", []))]
        lines += [f"  auto-fix pinned {p['node']} ({p['op']}): {p['reason']}" for p in fix["pinned"]]
        summary = tradeoff_lines(fix["outputs_before"], fix["outputs_after"], fix["tradeoff"])
        lines += ["  " + line for line in summary]
        lines.append(f"  auto-fix: {fix['stopped']}")
    return lines


def _quantized_lines(info: dict) -> list[str]:
    """What ``convert --precision int8|fp8`` prints: the counts, the calibration, the float nodes that matter."""
    nodes, calibration, low = info["nodes"], info["calibration"], info["precision"]
    lines = [f"Precision: {low} ({_count(nodes[low], 'node')} {low}, {nodes['float']} float; {info['format']}); "
             f"calibrated ({info['calibration_method']}) on {calibration['samples']} "
             + ("seeded random samples (see ? below)" if calibration.get("note") else f"samples of {calibration['source']}")]
    by_reason: dict[str, collections.Counter] = {}
    for node in info["float_nodes"]:
        by_reason.setdefault(node["reason"], collections.Counter())[node["op"]] += 1
    for reason, ops in by_reason.items():  # one line per reason: report.json names every node
        lines.append(f"  float: {', '.join(f'{count} {op}' for op, count in ops.most_common())}: {reason}")
    if fix := info.get("auto_fix"):
        lines += [f"  auto-fix round {index}: {_count(len(entry['kept_float']), 'node')} in float, "
                  f"{'pass' if entry['passed'] else 'fail'}" + _cost(entry, fix["quantized_ms"])
                  for index, entry in enumerate(fix["rounds"], 1)]
        lines.append(f"  auto-fix: {fix['stopped']}")
    return lines


def _cost(entry: dict, quantized_ms: float | None) -> str:
    """A round's latency beside the fully quantized graph's (this CPU, the failing feeds' batch)."""
    if entry["latency_ms"] is None or not quantized_ms:
        return ""
    return f", {entry['latency_ms']:.2f} ms a run against {quantized_ms:.2f} ms fully quantized ({entry['cost']:.2f}x)"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
