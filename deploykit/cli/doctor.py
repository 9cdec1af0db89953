"""``deploykit doctor [BUNDLE]``: parse, call deploykit.tools.doctor, print the checks. No logic here."""

from __future__ import annotations

import sys

import click

from deploykit import errors
from deploykit.cli._common import (
    BUNDLE, console, echo_json, handle_errors, json_option, trust_bundle_option, verbose_option,
)

_STATUS_STYLE = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[bold red]FAIL[/]", "skip": "[dim]skip[/]"}


@click.command("doctor")
@click.argument("bundle", type=BUNDLE, required=False)
@trust_bundle_option
@json_option("Print the checks and the facts as JSON.")
@verbose_option()
def doctor(bundle, trust_bundle, as_json, verbose):
    """Check drivers, CUDA, torch, ONNX Runtime, TensorRT and our libraries (and whether BUNDLE runs here).

    Names each native file of BUNDLE that this machine's deploykit did not build, what deploykit
    does instead of loading it, and that --trust-bundle loads it. Exits 3 when a check fails.
    """
    import dataclasses

    from deploykit.tools import doctor as diagnosis

    with handle_errors(verbose):
        checks, env = diagnosis.diagnose(bundle, trust_native=trust_bundle)
    failed = any(check.status == "fail" for check in checks)
    if as_json:
        echo_json({"ok": not failed, "checks": [dataclasses.asdict(c) for c in checks],
                   "environment": dataclasses.asdict(env)})
    else:
        _print_checks(checks)
    sys.exit(errors.EXIT_ENVIRONMENT if failed else errors.EXIT_OK)


def _print_checks(checks) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="deploykit doctor", title_justify="left", show_lines=False)
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for check in checks:
        fix = check.fix if check.status != "ok" else ""
        table.add_row(check.area, _STATUS_STYLE[check.status], escape(check.detail), escape(fix))
    console.print(table)
    problems = sum(c.status == "fail" for c in checks)
    console.print(f"[bold red]{problems} problem(s)[/]" if problems else "[green]no problems found[/]")
