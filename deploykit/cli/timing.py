"""``deploykit bench | profile``: time a bundle's backends (whole runs, or layer by layer); parse, call, print.

Both open the bundle, may load its source PyTorch model, and write their results (a JSON file
and a plot or page) into the bundle or -o: a probe write checks the folder before any timing,
and the results are written all or none (deploykit.bundle.write, as convert's bundle is). No
logic here: deploykit.tools.bench and .profile.
"""

from __future__ import annotations

from pathlib import Path

import click

from deploykit.cli._common import (
    BUNDLE, EXISTING_FILE, allow_failed_option, combine, console, echo_json, handle_errors, json_option,
    parse_keys, stage_printer, tolerance_option, trust_bundle_option, verbose_option,
)
from deploykit.cli._printing import print_notes, print_tuning_table

#: --model, --factory and --trust-pickle: the PyTorch model behind the bundle.
_source_options = combine(
    click.option("--model", type=EXISTING_FILE,
                 help="The source PyTorch model (default: the manifest's source, if the file is here)."),
    click.option("--factory", metavar="PKG.MODULE:FUNCTION", help="Build the model, then load --model as its state_dict."),
    click.option("--trust-pickle", is_flag=True, help="Allow a pickled nn.Module as --model."),
)

_rounds_option = click.option(
    "--rounds", type=click.IntRange(min=1), default=5, show_default=True,
    help="Time everything side by side in this many rounds, each timing every one in turn for its share of "
         "--iterations and --max-seconds; p50 is the median of the rounds' medians.")

_device_option = click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda",
                              help="Where everything runs.")


def _results_options(verb: str, results: str, page: str):
    """--allow-failed, -o, --json and -v of a command that writes ``results`` and ``page`` (bench, profile)."""
    return combine(
        allow_failed_option(f"{verb} a bundle whose validation failed."),
        click.option("-o", "--output", type=click.Path(path_type=Path, file_okay=False),
                     help=f"Where {results} and {page} go (default: the bundle)."),
        json_option(f"Print {results} on stdout."),
        verbose_option(),
    )


def _open_checked(bundle: Path, allow_failed: bool):
    """The opened bundle; one whose validation failed is timed only with --allow-failed."""
    from deploykit import runtime

    opened = runtime.open_bundle(bundle)
    runtime.check_validation(opened, allow_failed)
    return opened


def _results_folder(output: Path | None, bundle: Path) -> Path:
    """-o, else the bundle, refused before any timing where results could not be written."""
    from deploykit.bundle.write import check_results_folder

    folder = output or bundle
    check_results_folder(folder)
    return folder


# --------------------------------------------------------------------------- bench


@click.command("bench")
@click.argument("bundle", type=BUNDLE)
@_source_options
@click.option("--plain-onnx", type=EXISTING_FILE,
              help="A plain torch.onnx export of the model, to time against deploykit's graph.")
@click.option("--export-plain", is_flag=True, help="Re-export the source model for the plain-export contender.")
@click.option("--baseline", "baseline", type=BUNDLE,
              help="Another bundle of the same model (say the fp32 one) to time in ONNX Runtime in the same run.")
@click.option("--batch", "batches", metavar="N,N,...", help="Batch sizes (default: the bundle's MIN, OPT, MAX).")
@_device_option
@click.option("--only", metavar="KEY,KEY", help="Contenders to run: pytorch, torch-compile, reduce-overhead "
              "(torch.compile(mode='reduce-overhead')), pytorch-fp16, torch-compile-fp16, reduce-overhead-fp16 (and "
              "-bf16), ort-plain, ort-functions, ort-deploykit, ort-cuda-graph, baseline, baseline-cuda-graph, "
              "tensorrt, aoti-static, aoti-dynamic, openvino, deploykit-load (default: all that can run).")
@click.option("--warmup", type=click.IntRange(min=0), default=10, show_default=True, help="Untimed calls first.")
@click.option("--iterations", type=click.IntRange(min=1), default=100, show_default=True, help="Timed calls.")
@click.option("--max-seconds", type=click.FloatRange(min=0.1), default=20.0, show_default=True,
              help="Stop timing one contender and batch size after this long.")
@_rounds_option
@click.option("--tf32", is_flag=True, help="Let fp32 convolutions and matrix products use TF32, in ONNX Runtime and "
              "PyTorch alike (default: exact fp32, as validated).")
@trust_bundle_option
@_results_options("Benchmark", "bench.json", "bench.png")
def bench(bundle, model, factory, trust_pickle, plain_onnx, export_plain, baseline, batches, device, only, warmup,
          iterations, max_seconds, rounds, tf32, trust_bundle, allow_failed, output, as_json, verbose):
    """Time BUNDLE's backends side by side: latency percentiles and throughput per batch size."""
    from deploykit import runtime
    from deploykit.bundle.write import json_text, replace_files
    from deploykit.report.bench_plots import bench_png
    from deploykit.tools import bench as benchmark

    selected = parse_keys(only, benchmark.KEYS, "--only")  # click's usage error (exit 2), outside handle_errors
    with handle_errors(verbose) as written:
        folder = _results_folder(output, bundle)
        opened = _open_checked(bundle, allow_failed)
        settings = benchmark.Settings(benchmark.batch_plan(opened, benchmark.parse_batches(batches)),
                                      benchmark.resolve_device(device), warmup, iterations, max_seconds, rounds,
                                      tf32=tf32, trust_native=trust_bundle)
        wants_source = selected is None or any(key.startswith(benchmark.PYTORCH_KEYS) for key in selected) \
            or export_plain
        with stage_printer(quiet=as_json)("Loading the backends"):
            source = (benchmark.load_source(opened, model, factory, trust_pickle) if wants_source
                      else benchmark.SourceModel(None, "not selected (--only)"))
            found = benchmark.contenders(opened, settings, source, plain_onnx=plain_onnx,
                                         export_plain=export_plain, only=selected,
                                         baseline=runtime.open_bundle(baseline) if baseline else None)
        result = _with_progress(lambda tick: benchmark.run_benchmark(opened, settings, found, tick),
                                benchmark.progress_steps(settings, found), as_json)
        replace_files(folder, {"bench.json": json_text(result), "bench.png": bench_png(result)}, written)
    if as_json:
        echo_json(result)
        return
    _print_bench(result, folder)


def _with_progress(work, total: int, quiet: bool):
    """Run ``work(tick)`` under a rich progress bar; ``tick(text)`` starts the next measurement."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if quiet:
        return work(lambda text: None)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
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

    for entry in result["contenders"]:
        print_notes(entry["notes"], f"{entry['key']}: ")
    table = Table(title=f"{result['bundle']} on {result['device']}", title_justify="left")
    for column in ("backend", "batch", "p50 ms", "spread", "p90 ms", "p99 ms", "mean ms", "cv", "samples/s",
                   "vs best", "vs r-o"):
        table.add_column(column, justify="left" if column == "backend" else "right", no_wrap=column == "backend")
    for entry in result["contenders"]:
        for r in entry["results"]:
            ratio = "[green]best[/]" if r["vs_fastest"] == 1.0 else f"{r['vs_fastest']:.2f}x"
            versus = "" if r["vs_reduce_overhead"] is None else f"{r['vs_reduce_overhead']:.2f}x"
            table.add_row(entry["key"], str(r["batch"]), f"{r['p50_ms']:.3f}", f"{r['spread']:.1%}",
                          f"{r['p90_ms']:.3f}", f"{r['p99_ms']:.3f}", f"{r['mean_ms']:.3f}", f"{r['cv']:.2f}",
                          f"{r['throughput']:.0f}", ratio, versus)
    console.print(table)
    for entry in result["contenders"]:
        if entry["status"] != "ok" and not entry["reason"].startswith("not selected"):
            colour = "red" if entry["status"] == "failed" else "yellow"
            console.print(f"[{colour}]{entry['status']}:[/] {entry['key']} ({entry['label']}): {entry['reason']}",
                          soft_wrap=True)
    if any(r["cv"] > 0.5 for entry in result["contenders"] for r in entry["results"]):
        print_notes(["some timings vary a lot (cv > 0.5): is other work running on this machine? Use more "
                     "--iterations or a quieter machine"])
    console.print("p50: the median of the rounds' medians; spread: their range over p50. vs r-o: p50 over "
                  "torch.compile(mode=\"reduce-overhead\")'s in the same precision (below 1x: faster)", soft_wrap=True)
    console.print(f"Timing: {result['timing']}. Results: {folder / 'bench.json'}, plot: {folder / 'bench.png'}")


# --------------------------------------------------------------------------- tune


@click.command("tune")
@click.argument("bundle", type=BUNDLE)
@_source_options
@click.option("--batch", "batches", metavar="N,N,...", help="Batch sizes (default: the bundle's validated ones).")
@_device_option
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True, help="Untimed calls first.")
@click.option("--iterations", type=click.IntRange(min=1), default=50, show_default=True, help="Timed calls.")
@click.option("--max-seconds", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Stop timing one candidate and batch size after this long.")
@_rounds_option
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@tolerance_option
@trust_bundle_option
@allow_failed_option("Tune a bundle whose validation failed.")
@json_option("Print the tuning table on stdout.")
@verbose_option()
def tune(bundle, model, factory, trust_pickle, batches, device, warmup, iterations, max_seconds, rounds, seed,
         tolerances, trust_bundle, allow_failed, as_json, verbose):
    """Time every backend that runs BUNDLE here, check its outputs, record the fastest per batch size.

    deploykit.load(BUNDLE) then runs that choice on a machine with the same device and GPU
    (docs/tuning.md). Outputs are checked against the source model when it loads, else against
    the bundle's own graph on ONNX Runtime's CPU provider; the table in manifest.json says which.
    """
    from deploykit import runtime
    from deploykit.tools import bench as benchmark
    from deploykit.tuning.record import write_tuning
    from deploykit.tuning.tune import TuneSettings, tune_bundle

    with handle_errors(verbose):
        sizes = benchmark.parse_batches(batches)
        opened = _open_checked(bundle, allow_failed)
        sizes = benchmark.batch_plan(opened, sizes or opened.manifest.get("validation", {}).get("batch_sizes"))
        settings = TuneSettings(device=benchmark.resolve_device(device), warmup=warmup, iterations=iterations,
                                max_seconds=max_seconds, rounds=rounds, device_id=runtime.parse_device(device)[1],
                                seed=seed, trust_native=trust_bundle, tolerances=tolerances)
        with stage_printer(quiet=as_json)("Timing what runs here"):
            source = benchmark.load_source(opened, model, factory, trust_pickle)
            table = tune_bundle(opened, source.loaded, settings, sizes, source.reason)
        write_tuning(opened.path, table)
    if as_json:
        echo_json(table)
        return
    print_tuning_table(table)
    console.print(f"Recorded in {opened.path / 'manifest.json'}")


# --------------------------------------------------------------------------- profile

_PROFILED = ("onnxruntime", "tensorrt", "pytorch")


@click.command("profile")
@click.argument("bundle", type=BUNDLE)
@_source_options
@click.option("--batch", type=click.IntRange(min=1), help="Batch size (default: the bundle's optimum).")
@_device_option
@click.option("--only", metavar="KEY,KEY", help="Backends: onnxruntime, tensorrt, pytorch (default: all that can run).")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True, help="Unprofiled runs first.")
@click.option("--iterations", type=click.IntRange(min=1), default=20, show_default=True, help="Profiled runs.")
@click.option("--top", type=click.IntRange(min=1), default=15, show_default=True, help="Layers shown in tables and charts.")
@click.option("--no-op-library", is_flag=True, help="Profile deploykit's ops as their ONNX functions.")
@trust_bundle_option
@_results_options("Profile", "profile.json", "profile.html")
def profile(bundle, model, factory, trust_pickle, batch, device, only, warmup, iterations, top, no_op_library,
            trust_bundle, allow_failed, output, as_json, verbose):
    """Per-layer time of BUNDLE in ONNX Runtime, TensorRT and PyTorch, as a table and an HTML page."""
    from deploykit.bundle.write import json_text, replace_files
    from deploykit.tools import bench as benchmark
    from deploykit.tools import profile as profiling

    selected = parse_keys(only, _PROFILED, "--only")
    with handle_errors(verbose) as written:
        folder = _results_folder(output, bundle)
        opened = _open_checked(bundle, allow_failed)
        settings = profiling.Settings(batch, benchmark.resolve_device(device), warmup, iterations,
                                      op_library=not no_op_library, trust_native=trust_bundle)
        source = None
        if selected is None or "pytorch" in selected:
            source = benchmark.load_source(opened, model, factory, trust_pickle)
        result = profiling.run_profile(opened, settings, source, selected, stage_printer(quiet=as_json))
        replace_files(folder, {"profile.json": json_text(result), "profile.html": profiling.render_html(result, top)},
                      written)
    if as_json:
        echo_json(result)
        return
    _print_profile(result, top, folder)


def _print_profile(result: dict, top: int, folder: Path) -> None:
    from rich.table import Table

    for section in result["sections"]:
        if section["status"] != "ok":
            colour = "red" if section["status"] == "failed" else "yellow"
            console.print(f"[{colour}]{section['status']}:[/] {section['backend']}: {section['reason']}", soft_wrap=True)
            continue
        print_notes(section["notes"], f"{section['backend']}: ")
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
