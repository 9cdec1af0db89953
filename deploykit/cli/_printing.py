"""What several commands print alike: the runner's notes, the validation table, notes and failures, the
precision trade-off, skipped engine targets."""

from __future__ import annotations

from rich.table import Table

from deploykit.cli._common import console


def print_notes(notes, about: str = "") -> None:
    """What differs from the conversion where a command ran the bundle (a foreign op library swapped
    for this machine's build, a backend passed over, an unvalidated batch), so nothing is swapped
    silently: one ``note:`` line each, ``about`` naming whose where a command has several runners."""
    for note in notes:
        console.print(f"[yellow]note:[/] {about}{note}", soft_wrap=True)


def print_validation_table(candidate: dict) -> None:
    """Per output and batch: the metrics and the verdict of one validated candidate (convert, validate)."""
    table = Table(title=f"{candidate['label']} ({candidate['backend']}) vs PyTorch fp32", title_justify="left")
    for column in ("output", "batch", "max abs", "max rel", "cosine", "top-1", "verdict"):
        table.add_column(column, justify="left" if column == "output" else "right")
    for run in candidate["runs"]:
        for output in run["outputs"]:
            m = output["metrics"]
            # what min_top1 judged: int8 sets near ties aside (validation/compare.py's judged_top1)
            top1 = m["top1_agreement_decided"] if "top1_agreement_decided" in m else m.get("top1_agreement")
            table.add_row(
                output["name"], str(run["batch"]),
                f"{m.get('max_abs', float('nan')):.3g}", f"{m.get('max_rel', float('nan')):.3g}",
                f"{m.get('cosine', float('nan')):.7f}", "" if top1 is None else f"{top1:.3f}",
                _output_verdict(output, candidate.get("inconclusive", {})),
            )
    console.print(table)


def _output_verdict(output: dict, inconclusive: dict) -> str:
    """FAIL, pass* (within fp32 rounding), pass? (proves nothing: the output does not depend on the input), pass."""
    if not output["passed"]:
        return "[red]FAIL[/]"
    if output["name"] in inconclusive:
        return "[yellow]pass?[/]"
    return "[green]pass*[/]" if output["waived"] else "[green]pass[/]"


def skipped_text(engine: dict) -> str:
    """", not built for 7.5 (Turing: layer node_linear: FP32 GEMM is not supported)" or "" (convert, inspect)."""
    skipped = [f"{s['target']} ({s.get('architecture') or 'layer'}"
               f"{': layer ' + s['layer'] if s.get('layer') else ''}: {s['reason']})"
               for s in engine.get("skipped_targets") or []]
    return f", not built for {'; '.join(skipped)}" if skipped else ""


def print_notes_and_failures(notes: list[str], failures: list[str], inconclusive: list[str] = ()) -> None:
    """Outputs that passed within fp32 rounding (*), every failed check (✗), then the outputs whose
    comparison proves nothing (?) (convert, validate)."""
    for line in notes:
        console.print(f"[yellow]*[/] {line}", soft_wrap=True)
    for line in failures:
        console.print(f"[red]✗[/] {line}", soft_wrap=True)
    for line in inconclusive:
        console.print(f"[yellow]?[/] {line}", soft_wrap=True)


#: The colour of each verdict (convert, validate).
VERDICT_COLOURS = {"pass": "green", "inconclusive": "yellow", "fail": "red"}


def tradeoff_lines(before: dict, after: dict, tradeoff: dict) -> list[str]:
    """Each output's error before and after pinning nodes to fp32, and what the pins cost (debug, convert --auto-fix)."""
    lines = []
    for name, metrics in after.items():
        old = before.get(name, {})
        lines.append(f"Output {name}: {_output_text(old)} → {_output_text(metrics)}")
    lines.append(f"Trade-off: {tradeoff['fp32_nodes']} of {tradeoff['nodes']} nodes in fp32, "
                 f"{100 * tradeoff['fp32_share_of_multiply_adds']:.2f}% of the estimated multiply-adds")
    return lines


def round_lines(rounds: list[dict]) -> list[str]:
    """Each auto-fix round: what it pinned and why, its cost, the error after (debug, convert --auto-fix)."""
    lines = []
    for r in rounds:
        after = "-" if r["error_after"] is None else f"{r['error_after']:.3g}"
        verdict = "outputs pass" if r["passed"] else "outputs still fail"
        tried = f", {len(r['tried'])} groups tried cheapest first" if r["tried"] else ""
        lines.append(f"round {r['round']} ({r['kind']}{tried}): pinned {', '.join(r['nodes'])}; "
                     f"{r['multiply_adds']:.3g} multiply-adds ({100 * r['share_of_multiply_adds']:.2f}%); "
                     f"error after {after} of the tolerance, {verdict}; why: {r['why']}")
    return lines


def _output_text(metrics: dict) -> str:
    bad = (metrics.get("nan") or 0) + (metrics.get("inf") or 0)
    text = f"max |d| {_number(metrics.get('max_abs'))}, cosine {_number(metrics.get('cosine'), 7)}"
    return f"{text}, {bad} Inf/NaN" if bad else text


def _number(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def print_tuning_table(tuning: dict) -> None:
    """Every candidate per batch size: p50, max abs error, chosen / passed / failed / skipped and why (tune, convert --tune, inspect)."""
    where = tuning["device"] + (f", {tuning['gpu']} (sm {tuning['cuda_arch']})" if tuning.get("gpu") else "")
    table = Table(title=f"tuning on {where}, {tuning['created']}; checked against {tuning['reference']}",
                  title_justify="left")
    for column in ("batch", "candidate", "p50 ms", "max abs", "verdict"):
        table.add_column(column, justify="left" if column in ("candidate", "verdict") else "right", overflow="fold")
    for row in [*tuning["choices"], *tuning.get("unchosen", [])]:
        for c in row["candidates"]:
            timed = c["p50_ms"] is not None
            verdict = ("[bold green]chosen[/]" if c.get("chosen") else "[green]passed[/]" if c["passed"]
                       else f"[red]failed[/]: {c['reason']}" if timed else f"[yellow]skipped[/]: {c['reason']}")
            table.add_row(str(row["batch"]), c["label"], f"{c['p50_ms']:.3f}" if timed else "",
                          "" if c["max_abs"] is None else f"{c['max_abs']:.3g}", verdict)
    console.print(table)
    print_notes(tuning.get("notes", []))
