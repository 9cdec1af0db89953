"""``deploykit debug BUNDLE``: parse, call deploykit.tools.debug, print. No logic here.

Imported at the end of ``deploykit/cli.py``; the console and error handling are read from
there when the command runs (not at import time, which would be circular).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

#: Rows of the layer-wise table printed without --all.
_SHOWN_ROWS = 12


def _cli():
    from deploykit import cli

    return cli


@click.command()
@click.argument("bundle_dir", metavar="BUNDLE", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--layerwise", is_flag=True, help="Only compare node by node (fp32 bundles too); pin nothing.")
@click.option("--reference", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="ONNX graph to compare with (default: the bundle's model.fp32.onnx; for an fp32 bundle, "
                   "model.onnx without ONNX Runtime rewrites or our op library).")
@click.option("--inputs", "feeds_path", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="Inputs (.npz named after the model inputs) instead of seeded random ones.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--batch", type=click.IntRange(min=1),
              help="Batch size of the random inputs (default: the largest validated).")
@click.option("--max-pinned", type=click.IntRange(min=1), default=16, show_default=True,
              help="Stop once this many nodes are pinned to fp32.")
@click.option("--save", type=click.Path(path_type=Path, dir_okay=False), help="Write the fixed model.onnx here.")
@click.option("--all", "show_all", is_flag=True, help="List every node, not only those that diverge.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
def debug(bundle_dir, layerwise, reference, feeds_path, seed, batch, max_pinned, save, show_all, as_json,
          verbose):
    """Find the nodes that make BUNDLE's outputs diverge; for fp16/bf16, pin them to fp32 until it passes."""
    import onnx

    from deploykit.tools import debug as dbg

    cli = _cli()
    with cli._handle_errors(verbose):
        bundle = dbg.open_bundle(bundle_dir)
        feeds = dbg.bundle_feeds(bundle, feeds_path, seed, batch)
        reference_model = onnx.load(reference) if reference else None
        if layerwise or bundle.precision == "fp32":
            diffs = dbg.layerwise(bundle, feeds, reference_model)
            result = {"precision": bundle.precision, "layers": [d.to_json() for d in diffs]}
            passed = not any(d.diverged for d in diffs)
            printer = lambda: _print_layers(cli.console, diffs, show_all)  # noqa: E731
        else:
            fix = dbg.fix_bundle(bundle, feeds, max_pinned, reference_model)
            if save:
                onnx.save_model(fix.result.model, save)
            result, passed = {"precision": bundle.precision, **fix.to_json()}, fix.passed
            printer = lambda: _print_fix(cli.console, fix, save)  # noqa: E731
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        printer()
    sys.exit(0 if passed else 1)


def _error_text(error: dict | None) -> str:
    """A tensor's error: max |d| of max |ref| and cosine over finite elements, new Inf/NaN."""
    if not error:
        return "-"
    bad = f"{error['new_inf_nan']} new Inf/NaN" if error.get("new_inf_nan") else ""
    if bad and not error["max_ref"]:
        return bad
    finite = f"|d| {error['max_abs']:.3g} of {error['max_ref']:.3g}, cos {error['cosine']:.5f}"
    return f"{finite}, {bad}" if bad else finite


def _change(before: dict | None, after: dict | None) -> str:
    return f"{_error_text(before)} → {_error_text(after)}"


def _output_text(metrics: dict) -> str:
    bad = (metrics.get("nan") or 0) + (metrics.get("inf") or 0)
    text = f"max |d| {_number(metrics.get('max_abs'))}, cosine {_number(metrics.get('cosine'), 7)}"
    return f"{text}, {bad} Inf/NaN" if bad else text


def _print_layers(console, diffs, show_all: bool) -> None:
    from rich.table import Table

    diverged = [d for d in diffs if d.diverged]
    rows = diffs if show_all else diverged[:_SHOWN_ROWS]
    table = Table(title=f"{len(diverged)} of {len(diffs)} node outputs diverge", title_justify="left")
    for column in ("node", "op", "type", "max |d|", "max |ref|", "cosine", "new Inf/NaN", ""):
        table.add_column(column, justify="left" if column in ("node", "op", "type") else "right")
    for d in rows:
        table.add_row(d.node, d.op, d.dtype, f"{d.max_abs:.3g}", f"{d.scale:.3g}", f"{d.cosine:.6f}",
                      str(d.new_nonfinite or ""), "[red]diverges[/]" if d.diverged else "")
    console.print(table)
    if diverged:
        first = diverged[0]
        console.print(f"First to diverge: {first.node} ({first.op}), output {first.output}", soft_wrap=True)
    for origin in (d for d in diffs if d.new_nonfinite and d.inputs_finite):
        console.print(f"Creates Inf/NaN from finite inputs: {origin.node} ({origin.op})", soft_wrap=True)


def _print_fix(console, fix, save: Path | None) -> None:
    from rich.table import Table

    title = f"Pinned to fp32: {len(fix.pinned)} node(s) in {fix.rounds} round(s)"
    table = Table(title=title, title_justify="left")
    for column in ("node", "op", "why", "own error before → after", "symptom", "symptom before → after"):
        table.add_column(column)
    for pin in fix.pinned:
        table.add_row(pin.node, pin.op, pin.reason, _change(pin.error_before, pin.error_after), pin.symptom,
                      _change(pin.symptom_before, pin.symptom_after))
    console.print(table)
    for line in tradeoff_lines(fix.outputs_before, fix.outputs_after, fix.tradeoff):
        console.print(line, soft_wrap=True)
    for failure in fix.failures:
        console.print(f"[red]✗[/] {failure}", soft_wrap=True)
    colour = "green" if fix.passed else "red"
    console.print(f"[bold {colour}]{'PASS' if fix.passed else 'FAIL'}[/]: {fix.stopped}")
    if save:
        console.print(f"Fixed graph: {save}")


def tradeoff_lines(before: dict, after: dict, tradeoff: dict) -> list[str]:
    lines = []
    for name, metrics in after.items():
        old = before.get(name, {})
        lines.append(f"Output {name}: {_output_text(old)} → {_output_text(metrics)}")
    lines.append(f"Trade-off: {tradeoff['fp32_nodes']} of {tradeoff['nodes']} nodes in fp32, "
                 f"{100 * tradeoff['fp32_share_of_multiply_adds']:.2f}% of the estimated multiply-adds")
    return lines


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _number(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def precision_lines(report: dict) -> list[str]:
    """What ``convert`` prints about the precision stage (nothing for fp32)."""
    info = report.get("precision") or {}
    if info.get("precision", "fp32") == "fp32":
        return []
    nodes, low = info["nodes"], info["precision"]
    lines = [f"Precision: {low} ({_count(nodes[low], 'node')} {low}, {nodes['fp32']} fp32, "
             f"{_count(info['casts'], 'cast')}); {info['execution']}"]
    quiet = ("on the fp32 side", "auto-fix:")  # cheap nodes, and pins listed below
    sensitive = [n for n in info["fp32_nodes"] if not n["reason"].startswith(quiet)]
    lines += [f"  fp32: {n['node']} ({n['op']}): {n['reason']}" for n in sensitive[:8]]
    if len(sensitive) > 8:
        lines.append(f"  ... and {len(sensitive) - 8} more (report.json lists them)")
    fix = info.get("auto_fix")
    if fix:
        lines += [f"  auto-fix pinned {p['node']} ({p['op']}): {p['reason']}" for p in fix["pinned"]]
        summary = tradeoff_lines(fix["outputs_before"], fix["outputs_after"], fix["tradeoff"])
        lines += ["  " + line for line in summary]
        lines.append(f"  auto-fix: {fix['stopped']}")
    return lines
