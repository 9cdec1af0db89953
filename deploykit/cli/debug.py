"""``deploykit debug BUNDLE``: parse, call deploykit.tools.debug, print. No logic here."""

from __future__ import annotations

from pathlib import Path

import click

from deploykit import errors
from deploykit.cli._common import (
    BUNDLE, EXISTING_FILE, console, echo_json, exit_with_verdict, handle_errors, inputs_option, json_option, seed_option,
    trust_bundle_option, verbose_option,
)
from deploykit.cli._printing import print_notes, print_notes_and_failures, round_lines, tradeoff_lines

#: Rows of the layer-wise table printed without --all.
_SHOWN_ROWS = 12


@click.command()
@click.argument("bundle_dir", metavar="BUNDLE", type=BUNDLE)
@click.option("--layerwise", is_flag=True, help="Only compare node by node (fp32 bundles too); pin nothing.")
@click.option("--reference", type=EXISTING_FILE,
              help="ONNX graph to compare with (default: the bundle's model.fp32.onnx; for an fp32 bundle, "
                   "model.onnx without ONNX Runtime rewrites or our op library).")
@inputs_option("Inputs (.npz named after the model inputs; floats cast to float32 only where no value changes) "
               "instead of seeded random ones.")
@seed_option()
@click.option("--batch", type=click.IntRange(min=1),
              help="Batch size of the random inputs (default: the largest validated).")
@click.option("--max-pinned", type=click.IntRange(min=1), default=16, show_default=True,
              help="Stop once this many nodes are pinned to fp32 as single culprits (groups are bounded "
                   "by their cost).")
@click.option("--save", type=click.Path(path_type=Path, dir_okay=False), help="Write the fixed model.onnx here.")
@click.option("--all", "show_all", is_flag=True, help="List every node, not only those that diverge.")
@trust_bundle_option
@json_option("Print the result as JSON on stdout.")
@verbose_option()
def debug(bundle_dir, layerwise, reference, feeds_path, seed, batch, max_pinned, save, show_all, trust_bundle,
          as_json, verbose):
    """Find the nodes that make BUNDLE's outputs diverge; for fp16/bf16, pin them to fp32 until it passes."""
    import onnx

    from deploykit.tools import debug as dbg

    with handle_errors(verbose):
        bundle = dbg.open_bundle(bundle_dir, trust_bundle)
        feeds = dbg.bundle_feeds(bundle, feeds_path, seed, batch)
        reference_model = onnx.load(reference) if reference else None
        head = {"precision": bundle.precision, "notes": bundle.notes}
        if layerwise or bundle.precision == "fp32":
            diffs = dbg.layerwise(bundle, feeds, reference_model)
            result = {**head, "layers": [d.to_json() for d in diffs]}
            passed = not any(d.diverged for d in diffs)
            printer = lambda: _print_layers(diffs, show_all)  # noqa: E731
        else:
            fix = dbg.fix_bundle(bundle, feeds, max_pinned, reference_model)
            if save:
                onnx.save_model(fix.result.model, save)
            result, passed = {**head, **fix.to_json()}, fix.passed
            printer = lambda: _print_fix(fix, save)  # noqa: E731
    if as_json:
        echo_json(result)
    else:
        print_notes(bundle.notes)
        printer()
    exit_with_verdict(errors.verdict(passed))


def _print_layers(diffs, show_all: bool) -> None:
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


def _print_fix(fix, save: Path | None) -> None:
    from rich.table import Table

    title = f"Pinned to fp32: {len(fix.pinned)} node(s) in {fix.rounds} round(s)"
    table = Table(title=title, title_justify="left")
    for column in ("node", "op", "why", "own error before → after", "symptom", "symptom before → after"):
        table.add_column(column)
    for pin in fix.pinned:
        table.add_row(pin.node, pin.op, pin.reason, _change(pin.error_before, pin.error_after), pin.symptom,
                      _change(pin.symptom_before, pin.symptom_after))
    console.print(table)
    for line in round_lines([r.to_json() for r in fix.round_log]):
        console.print(line, soft_wrap=True)
    for line in tradeoff_lines(fix.outputs_before, fix.outputs_after, fix.tradeoff):
        console.print(line, soft_wrap=True)
    print_notes_and_failures([], fix.failures)
    colour = "green" if fix.passed else "red"
    console.print(f"[bold {colour}]{'PASS' if fix.passed else 'FAIL'}[/]: {fix.stopped}")
    if save:
        console.print(f"Fixed graph: {save}")


def _change(before: dict | None, after: dict | None) -> str:
    return f"{_error_text(before)} → {_error_text(after)}"


def _error_text(error: dict | None) -> str:
    """A tensor's error: max |d| of max |ref| and cosine over finite elements, new Inf/NaN."""
    if not error:
        return "-"
    bad = f"{error['new_inf_nan']} new Inf/NaN" if error.get("new_inf_nan") else ""
    if bad and not error["max_ref"]:
        return bad
    finite = f"|d| {error['max_abs']:.3g} of {error['max_ref']:.3g}, cos {error['cosine']:.5f}"
    return f"{finite}, {bad}" if bad else finite
