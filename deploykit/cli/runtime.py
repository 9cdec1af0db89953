"""``deploykit run | validate | inspect | doctor | bench | profile``: parse, call the runtime modules, print. No logic here.

Imported at the end of ``deploykit/cli.py``; the shared error handling and console are read
from there when a command runs (not at import, which would be circular). Heavy modules are
imported inside the commands so that ``deploykit --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

BUNDLE = click.Path(path_type=Path, exists=True, file_okay=False)


def _cli():
    from deploykit import cli

    return cli


def _backend_options(function):
    """--backend, --device, --allow-failed and --no-op-library, shared by run, bench and profile."""
    for decorator in reversed((
        click.option("--backend", type=click.Choice(["auto", "onnxruntime", "tensorrt"]), default="auto",
                     show_default=True, help="auto: the TensorRT engine where this GPU runs it, else ONNX Runtime."),
        click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda[:N]",
                     help="Where to run."),
        click.option("--allow-failed", is_flag=True, help="Run a bundle whose validation failed."),
        click.option("--no-op-library", is_flag=True,
                     help="Do not load libdeploykit_ort.so: deploykit ops run as their ONNX functions."),
    )):
        function = decorator(function)
    return function


def _print_notes(runner) -> None:
    for note in runner.notes:
        _cli().console.print(f"[yellow]note:[/] {note}", soft_wrap=True)


# --------------------------------------------------------------------------- run


@click.command("run")
@click.argument("bundle", type=BUNDLE)
@click.option("--inputs", "feeds_path", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="Inputs as .npz, named after the model inputs (default: seeded random inputs).")
@click.option("-o", "--output", type=click.Path(path_type=Path, dir_okay=False), help="Write the outputs to this .npz.")
@click.option("--batch", type=click.IntRange(min=1), help="Batch size of the random inputs (default: the optimum).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@_backend_options
@click.option("--json", "as_json", is_flag=True, help="Print what ran and the outputs' statistics as JSON.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
def run(bundle, feeds_path, output, batch, seed, backend, device, allow_failed, no_op_library, as_json, verbose):
    """Run BUNDLE on --inputs (or random inputs) and write its outputs with -o."""
    import numpy as np

    from deploykit import runtime

    cli = _cli()
    with cli._handle_errors(verbose):
        runner = runtime.load(bundle, backend, device, allow_failed=allow_failed, op_library=not no_op_library)
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
        click.echo(json.dumps(summary, indent=2))
        return
    _print_notes(runner)
    _print_run(summary)


def _stats(array) -> dict:
    import numpy as np

    values = np.asarray(array)
    numeric = values.astype(np.float64) if values.size else np.zeros(1)
    return {"shape": list(values.shape), "dtype": str(values.dtype), "min": float(numeric.min()),
            "max": float(numeric.max()), "mean": float(numeric.mean())}


def _print_run(summary: dict) -> None:
    from rich.table import Table

    console = _cli().console
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
@click.option("--factory", metavar="PKG.MODULE:FUNCTION",
              help="Build the model with this function and load MODEL as its state_dict.")
@click.option("--trust-pickle", is_flag=True, help="Allow a pickled nn.Module (unpickling runs code from the file).")
@click.option("--inputs", "feeds_path", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="Validate on these inputs (.npz named after the model inputs).")
@click.option("--batch", "batches", type=click.IntRange(min=1), multiple=True,
              help="Batch size of the random inputs; repeat for several (default: the bundle's min, opt and max).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--tolerance", "tolerances", multiple=True, metavar="[OUTPUT:]KEY=VALUE,...",
              help="Override atol, rtol, min_cosine or min_top1, for all outputs or one.")
@_backend_options
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON on stdout.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
def validate(bundle, model, factory, trust_pickle, feeds_path, batches, seed, tolerances, backend, device,
             allow_failed, no_op_library, as_json, verbose):
    """Compare BUNDLE, run here as it will be deployed, with MODEL in PyTorch (fp32, CPU).

    Conversion validated on the converting machine; this checks the bundle on this machine's
    backend (the CUDA provider or TensorRT engine on a GPU) and on your data. The bundle is only
    read. Exit code 1 when an output fails.
    """
    from deploykit.validation.bundle import validate_bundle

    cli = _cli()
    with cli._handle_errors(verbose):
        result = validate_bundle(bundle, model, factory=factory, trust_pickle=trust_pickle, feeds_path=feeds_path,
                                 batches=list(batches), seed=seed, tolerances=tolerances, backend=backend,
                                 device=device, allow_failed=allow_failed, op_library=not no_op_library)
    summary = result.to_json()
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        _print_notes(result.runner)
        cli.print_validation_table(summary["validation"])
        cli.print_notes_and_failures(result.validation.rounding_notes(), summary["failures"])
        verdict = "[bold green]PASS[/]" if result.passed else "[bold red]FAIL[/]"
        cli.console.print(f"{verdict}: {summary['bundle']} on {result.runner.name} against {model} "
                          f"({summary['inputs']})", soft_wrap=True)
    sys.exit(cli.errors.EXIT_OK if result.passed else cli.errors.EXIT_VALIDATION_FAILED)


# --------------------------------------------------------------------------- inspect


@click.command("inspect")
@click.argument("bundle", type=BUNDLE)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
def inspect(bundle, as_json, verbose):
    """Show what BUNDLE holds (inputs, outputs, precision, ops, engines, validation) and check its files.

    Reads manifest.json only: nothing is loaded or run. Exit code 1 when a file is missing or
    changed since conversion.
    """
    from deploykit.bundle.inspect import describe_bundle

    cli = _cli()
    with cli._handle_errors(verbose):
        info = describe_bundle(bundle)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        _print_info(info)
    sys.exit(cli.errors.EXIT_OK if info["files_ok"] else cli.errors.EXIT_VALIDATION_FAILED)


def _print_info(info: dict) -> None:
    from rich.table import Table

    console = _cli().console
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
                      f"targets {', '.join(engine['targets'] or [])})", soft_wrap=True)
    changed = [f"{name} ({', '.join(f'{k} {v}' for k, v in changes.items())})"
               for name, changes in info["passes"].items() if changes]
    console.print(f"passes: {'; '.join(changed) or 'none changed the exported graph'}", soft_wrap=True)
    validation = info["validation"]
    worst = ", ".join(f"{name} {value:.3g}" for name, value in validation.get("max_abs", {}).items())
    console.print(f"validation at conversion: {'passed' if validation.get('passed') else 'FAILED'} on "
                  f"{validation.get('backend')}, batch sizes {validation.get('batch_sizes')}, max abs {worst}",
                  soft_wrap=True)
    for name, entry in info["files"].items():
        status = "[green]ok[/]" if entry["status"] == "ok" else f"[bold red]{entry['status']}[/]"
        console.print(f"file {name}: {entry['bytes']} bytes, sha256 {status}")


# --------------------------------------------------------------------------- doctor

STATUS_STYLE = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[bold red]FAIL[/]", "skip": "[dim]skip[/]"}


@click.command("doctor")
@click.argument("bundle", type=BUNDLE, required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the checks and the facts as JSON.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
def doctor(bundle, as_json, verbose):
    """Check drivers, CUDA, torch, ONNX Runtime, TensorRT and our libraries (and whether BUNDLE runs here).

    Exits 3 when a check fails.
    """
    import dataclasses

    from deploykit.tools import doctor as diagnosis
    from deploykit.errors import EXIT_ENVIRONMENT

    cli = _cli()
    with cli._handle_errors(verbose):
        checks, env = diagnosis.diagnose(bundle)
    failed = any(check.status == "fail" for check in checks)
    if as_json:
        click.echo(json.dumps({"ok": not failed, "checks": [dataclasses.asdict(c) for c in checks],
                               "environment": dataclasses.asdict(env)}, indent=2))
    else:
        _print_checks(checks)
    sys.exit(EXIT_ENVIRONMENT if failed else 0)


def _print_checks(checks) -> None:
    from rich.table import Table

    table = Table(title="deploykit doctor", title_justify="left", show_lines=False)
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for check in checks:
        table.add_row(check.area, STATUS_STYLE[check.status], check.detail, check.fix if check.status != "ok" else "")
    console = _cli().console
    console.print(table)
    problems = sum(c.status == "fail" for c in checks)
    console.print(f"[bold red]{problems} problem(s)[/]" if problems else "[green]no problems found[/]")


# --------------------------------------------------------------------------- bench


def _source_options(function):
    """--model, --factory and --trust-pickle: the PyTorch model behind the bundle."""
    for decorator in reversed((
        click.option("--model", type=click.Path(path_type=Path, exists=True, dir_okay=False),
                     help="The source PyTorch model (default: the manifest's source, if the file is here)."),
        click.option("--factory", metavar="PKG.MODULE:FUNCTION", help="Build the model, then load --model as its state_dict."),
        click.option("--trust-pickle", is_flag=True, help="Allow a pickled nn.Module as --model."),
    )):
        function = decorator(function)
    return function


@click.command("bench")
@click.argument("bundle", type=BUNDLE)
@_source_options
@click.option("--plain-onnx", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="A plain torch.onnx export of the model, to time against deploykit's graph.")
@click.option("--export-plain", is_flag=True, help="Re-export the source model for the plain-export contender.")
@click.option("--baseline", "baseline", type=BUNDLE,
              help="Another bundle of the same model (say the fp32 one) to time in ONNX Runtime in the same run.")
@click.option("--batch", "batches", metavar="N,N,...", help="Batch sizes (default: the bundle's MIN, OPT, MAX).")
@click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda", help="Where everything runs.")
@click.option("--only", metavar="KEY,KEY", help="Contenders to run: pytorch, torch-compile, pytorch-fp16, "
              "torch-compile-fp16 (and -bf16), ort-plain, ort-functions, ort-deploykit, ort-cuda-graph, baseline, "
              "baseline-cuda-graph, tensorrt (default: all that can run).")
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True, help="Untimed calls first.")
@click.option("--iterations", type=click.IntRange(min=1), default=100, show_default=True, help="Timed calls.")
@click.option("--max-seconds", type=click.FloatRange(min=0.1), default=20.0, show_default=True,
              help="Stop timing one contender and batch size after this long.")
@click.option("--tf32", is_flag=True, help="Let fp32 convolutions and matrix products use TF32, in ONNX Runtime and "
              "PyTorch alike (default: exact fp32, as validated).")
@click.option("--allow-failed", is_flag=True, help="Benchmark a bundle whose validation failed.")
@click.option("-o", "--output", type=click.Path(path_type=Path, file_okay=False),
              help="Where bench.json and bench.png go (default: the bundle).")
@click.option("--json", "as_json", is_flag=True, help="Print bench.json on stdout.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
def bench(bundle, model, factory, trust_pickle, plain_onnx, export_plain, baseline, batches, device, only, warmup,
          iterations, max_seconds, tf32, allow_failed, output, as_json, verbose):
    """Time BUNDLE's backends side by side: latency percentiles and throughput per batch size."""
    from deploykit import runtime
    from deploykit.tools import bench as benchmark
    from deploykit.bundle.write import write_json
    from deploykit.report.bench_plots import bench_png

    cli = _cli()
    with cli._handle_errors(verbose):
        opened = runtime.open_bundle(bundle)
        runtime.check_validation(opened, allow_failed)
        selected = _parse_only(only, benchmark.KEYS)
        settings = benchmark.Settings(benchmark.batch_plan(opened, benchmark.parse_batches(batches)),
                                      benchmark.resolve_device(device), warmup, iterations, max_seconds, tf32=tf32)
        wants_source = selected is None or any(key.startswith(("pytorch", "torch-compile")) for key in selected) \
            or export_plain
        with cli._stage_printer(quiet=as_json)("Loading the backends"):
            source = (benchmark.load_source(opened, model, factory, trust_pickle) if wants_source
                      else benchmark.SourceModel(None, "not selected (--only)"))
            found = benchmark.contenders(opened, settings, source, plain_onnx=plain_onnx,
                                         export_plain=export_plain, only=selected,
                                         baseline=runtime.open_bundle(baseline) if baseline else None)
        result = _with_progress(lambda tick: benchmark.run_benchmark(opened, settings, found, tick),
                                sum(c.setup is not None for c in found) * (1 + len(settings.batch_sizes)), as_json)
        folder = output or bundle
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / "bench.json", result)
        (folder / "bench.png").write_bytes(bench_png(result))
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    _print_bench(result, folder)


def _parse_only(text: str | None, keys) -> set[str] | None:
    if not text:
        return None
    chosen = {part.strip() for part in text.split(",") if part.strip()}
    unknown = chosen - set(keys)
    if unknown:
        raise click.BadParameter(f"unknown {', '.join(sorted(unknown))}; choose from {', '.join(keys)}", param_hint="--only")
    return chosen


def _with_progress(work, total: int, quiet: bool):
    """Run ``work(tick)`` under a rich progress bar; ``tick(text)`` starts the next measurement."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if quiet:
        return work(lambda text: None)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=_cli().console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=total)
        started = [0]

        def tick(text: str) -> None:
            progress.update(task, description=text, completed=started[0])
            started[0] += 1

        result = work(tick)
        progress.update(task, completed=total)
    return result


def _print_bench(result: dict, folder: Path) -> None:
    from rich.table import Table

    console = _cli().console
    table = Table(title=f"{result['bundle']} on {result['device']}", title_justify="left")
    for column in ("backend", "batch", "p50 ms", "p90 ms", "p99 ms", "mean ms", "cv", "samples/s", "vs best"):
        table.add_column(column, justify="left" if column == "backend" else "right", no_wrap=column == "backend")
    for entry in result["contenders"]:
        for r in entry["results"]:
            ratio = "[green]best[/]" if r["vs_fastest"] == 1.0 else f"{r['vs_fastest']:.2f}x"
            table.add_row(entry["key"], str(r["batch"]), f"{r['p50_ms']:.3f}", f"{r['p90_ms']:.3f}",
                          f"{r['p99_ms']:.3f}", f"{r['mean_ms']:.3f}", f"{r['cv']:.2f}", f"{r['throughput']:.0f}", ratio)
    console.print(table)
    for entry in result["contenders"]:
        if entry["status"] != "ok" and not entry["reason"].startswith("not selected"):
            colour = "red" if entry["status"] == "failed" else "yellow"
            console.print(f"[{colour}]{entry['status']}:[/] {entry['key']} ({entry['label']}): {entry['reason']}",
                          soft_wrap=True)
    if any(r["cv"] > 0.5 for entry in result["contenders"] for r in entry["results"]):
        console.print("[yellow]note:[/] some timings vary a lot (cv > 0.5): is other work running on this machine? "
                      "Use more --iterations or a quieter machine", soft_wrap=True)
    console.print(f"Timing: {result['timing']}. Results: {folder / 'bench.json'}, plot: {folder / 'bench.png'}")


# --------------------------------------------------------------------------- profile


@click.command("profile")
@click.argument("bundle", type=BUNDLE)
@_source_options
@click.option("--batch", type=click.IntRange(min=1), help="Batch size (default: the bundle's optimum).")
@click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda", help="Where everything runs.")
@click.option("--only", metavar="KEY,KEY", help="Backends: onnxruntime, tensorrt, pytorch (default: all that can run).")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True, help="Unprofiled runs first.")
@click.option("--iterations", type=click.IntRange(min=1), default=20, show_default=True, help="Profiled runs.")
@click.option("--top", type=click.IntRange(min=1), default=15, show_default=True, help="Layers shown in tables and charts.")
@click.option("--no-op-library", is_flag=True, help="Profile deploykit's ops as their ONNX functions.")
@click.option("--allow-failed", is_flag=True, help="Profile a bundle whose validation failed.")
@click.option("-o", "--output", type=click.Path(path_type=Path, file_okay=False),
              help="Where profile.json and profile.html go (default: the bundle).")
@click.option("--json", "as_json", is_flag=True, help="Print profile.json on stdout.")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
def profile(bundle, model, factory, trust_pickle, batch, device, only, warmup, iterations, top, no_op_library,
            allow_failed, output, as_json, verbose):
    """Per-layer time of BUNDLE in ONNX Runtime, TensorRT and PyTorch, as a table and an HTML page."""
    from deploykit import runtime
    from deploykit.tools import bench as benchmark
    from deploykit.tools import profile as profiling
    from deploykit.bundle.write import write_json

    cli = _cli()
    with cli._handle_errors(verbose):
        opened = runtime.open_bundle(bundle)
        runtime.check_validation(opened, allow_failed)
        selected = _parse_only(only, ("onnxruntime", "tensorrt", "pytorch"))
        settings = profiling.Settings(batch, benchmark.resolve_device(device), warmup, iterations,
                                      op_library=not no_op_library)
        source = None
        if selected is None or "pytorch" in selected:
            source = benchmark.load_source(opened, model, factory, trust_pickle)
        result = profiling.run_profile(opened, settings, source, selected, cli._stage_printer(quiet=as_json))
        folder = output or bundle
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / "profile.json", result)
        (folder / "profile.html").write_text(profiling.render_html(result, top))
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    _print_profile(result, top, folder)


def _print_profile(result: dict, top: int, folder: Path) -> None:
    from rich.table import Table

    console = _cli().console
    for section in result["sections"]:
        if section["status"] != "ok":
            colour = "red" if section["status"] == "failed" else "yellow"
            console.print(f"[{colour}]{section['status']}:[/] {section['backend']}: {section['reason']}", soft_wrap=True)
            continue
        table = Table(title=f"{section['backend']}: {section['per_run_ms']:.3f} ms per run, deploykit ops "
                            f"{100 * section['custom_share']:.1f}%", title_justify="left")
        for column in ("layer", "op type", "ms/run", "share"):
            table.add_column(column, justify="right" if column in ("ms/run", "share") else "left", overflow="fold")
        for row in section["layers"][:top]:
            style = "bold red" if row["custom"] else None
            table.add_row(row["name"], row["op_type"], f"{row['per_run_ms']:.4f}", f"{100 * row['share']:.1f}%",
                          style=style)
        console.print(table)
        types = ", ".join(f"{t['op_type']} {100 * t['share']:.1f}%" for t in section["op_types"][:6])
        console.print(f"By op type: {types}", soft_wrap=True)
    console.print(f"Profile: {folder / 'profile.json'}, page: {folder / 'profile.html'}")


COMMANDS = [run, doctor, bench, profile]
