"""Triton's C++ load generator, perf_analyzer, against any Open Inference Protocol server
(``deploykit serve``, tritonserver): throughput, p50/p95/p99 latency and errors per concurrency.

perf_analyzer (Triton 2.51, fetched once into deploykit's cache by deploykit/tools/triton_tools.py)
runs once per protocol and concurrency, ``--concurrency-range N:N`` in its synchronous mode (N
threads, one request in flight each), so a level that fails leaves the others measured. Each
level's CSV (``-f``) and log stay in ``--out`` beside perf_analyzer.json and perf_analyzer.md.

Errors are counted, never dropped: perf_analyzer stops a worker thread at its first failed request,
prints ``Thread [i] had error: ...`` and exits non-zero, and it exits 0 without a CSV row when it
finds no stable measurement; either way the level has no numbers, its ``errors`` (threads that
failed) and ``failure`` (why) say so, and this script exits 1. Windows are judged stable on
throughput and p99 latency; a level where p99 never settles (on a GPU server at 256 connections, a
few slow answers move it by more than 20 %) is measured again judged on throughput and mean latency,
and its row says ``stable on: mean`` (its p50/p95/p99 still come from perf_analyzer's CSV). Inputs
are zeros by default (perf_analyzer's random bytes may hold NaN, which deploykit serve refuses as it
should), or a JSON file of real inputs (``--input-data``). The answers' correctness is serve_load.py's to check.

Usage: python benchmarks/perf_analyzer.py MODEL --http HOST:PORT [--grpc HOST:PORT] --out DIR
           [--concurrency 1,16,64,128,256] [--measurement-interval-ms 5000] [--stability-percentage 10]
           [--batch-size 1] [--input-data zero|FILE.json] [--shape NAME:D1,D2 ...]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from deploykit.errors import DeployKitError

#: perf_analyzer's default --max-trials: measurement windows it tries before it gives up on stability
MAX_TRIALS = 10
UNSTABLE = "no stable measurement"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the model's name on the server")
    parser.add_argument("--http", metavar="HOST:PORT", help="the server's HTTP endpoint")
    parser.add_argument("--grpc", metavar="HOST:PORT", help="the server's gRPC endpoint (deploykit serve has none)")
    parser.add_argument("--concurrency", type=counts, default=[1, 16, 64, 128, 256], help="comma list, each run")
    parser.add_argument("--measurement-interval-ms", type=int, default=5000, help="perf_analyzer's -p")
    parser.add_argument("--stability-percentage", type=float, default=10, help="perf_analyzer's -s")
    parser.add_argument("--batch-size", type=int, default=1, help="rows per request (perf_analyzer's -b)")
    parser.add_argument("--input-data", default="zero", help="zero, or a perf_analyzer JSON file of real inputs")
    parser.add_argument("--shape", action="append", default=[], metavar="NAME:D1,D2",
                        help="an input's shape without the batch, where it is dynamic (repeat per input)")
    parser.add_argument("--out", type=Path, required=True, help="perf_analyzer.json, .md and each level's CSV and log")
    args = parser.parse_args()
    targets = [(protocol, url) for protocol, url in (("http", args.http), ("grpc", args.grpc)) if url]
    if not targets:
        parser.error("give --http HOST:PORT, --grpc HOST:PORT or both")
    from deploykit.tools import triton_tools

    program = triton_tools.perf_analyzer()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for protocol, url in targets:
        for concurrency in args.concurrency:
            results.append(measure(program, args, protocol, url, concurrency))
            progress(results[-1])
    table = markdown(results, args)
    print(table)
    (args.out / "perf_analyzer.md").write_text(table + "\n")
    (args.out / "perf_analyzer.json").write_text(json.dumps({"model": args.model, "created": time.strftime(
        "%Y-%m-%dT%H:%M:%S%z"), "args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))
    return 1 if any(r["failure"] for r in results) else 0


def counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def measure(program, args, protocol: str, url: str, concurrency: int) -> dict:
    """One perf_analyzer run at one concurrency: its numbers, or why it has none; a run whose p99 never
    settled is run again judged on mean latency (``stable_on``)."""
    result = run_level(program, args, protocol, url, concurrency, stable_on="p99")
    if result["failure"] is not None and result["failure"].startswith(UNSTABLE):
        result = run_level(program, args, protocol, url, concurrency, stable_on="mean")
    return result


def run_level(program, args, protocol: str, url: str, concurrency: int, stable_on: str) -> dict:
    """perf_analyzer at one concurrency, windows judged on throughput and ``stable_on`` latency."""
    stem = args.out / f"{protocol}-c{concurrency}{'' if stable_on == 'p99' else '-mean'}"
    report, log = stem.with_suffix(".csv"), stem.with_suffix(".log")
    report.unlink(missing_ok=True)
    command = [*program.command, "-m", args.model, "-u", url, "-i", protocol,
               "--concurrency-range", f"{concurrency}:{concurrency}", "-p", str(args.measurement_interval_ms),
               "-s", str(args.stability_percentage), "-r", str(MAX_TRIALS),
               *(["--percentile=99"] if stable_on == "p99" else []),
               "-b", str(args.batch_size), "--input-data", args.input_data, "-f", str(report),
               *(part for shape in args.shape for part in ("--shape", shape))]
    limit = 60 + 2 * MAX_TRIALS * args.measurement_interval_ms / 1000  # trials, plus start-up and draining
    with open(log, "w") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=program.env,
                                  timeout=limit).returncode
        except subprocess.TimeoutExpired:
            code = None
    return {"protocol": protocol, "concurrency": concurrency, "exit_code": code, "stable_on": stable_on,
            **outcome(code, report, log.read_text(), limit)}


def outcome(code: int | None, report: Path, output: str, limit: float) -> dict:
    """The CSV row's throughput and percentiles (perf_analyzer writes microseconds), the failed
    threads' count, and the failure: a failed request, an unstable measurement, anything else."""
    failed = re.findall(r"^Thread \[\d+\] had error: (.*)$", output, re.MULTILINE)
    row = read_row(report) if code == 0 else None
    if row is not None and not failed:
        return {"throughput": float(row["Inferences/Second"]),
                **{f"p{p}_ms": float(row[f"p{p} latency"]) / 1e3 for p in (50, 95, 99)},
                "errors": 0, "failure": None}
    if code is None:
        why = f"perf_analyzer did not finish within {limit:.0f} s"
    elif failed:
        why = failed[0]
    elif "Failed to obtain stable measurement" in output:
        why = (f"{UNSTABLE} within {MAX_TRIALS} windows: raise --measurement-interval-ms or "
               "--stability-percentage")
    else:
        why = last_line(output) or f"perf_analyzer exited {code} without a CSV row"
    return {"throughput": None, "p50_ms": None, "p95_ms": None, "p99_ms": None, "errors": len(failed),
            "failure": why}


def read_row(report: Path) -> dict | None:
    """The CSV's one measured row (the header names the columns), None when there is none."""
    if not report.is_file():
        return None
    with open(report, newline="") as handle:
        rows = list(csv.DictReader(handle))
    return rows[0] if rows else None


def last_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def progress(result: dict) -> None:
    """A line on stderr per level as it ends: a run cut by a time limit says how far it got."""
    numbers = (f"{result['throughput']:.0f} infer/s, p99 {result['p99_ms']:.2f} ms" if result["failure"] is None
               else f"FAILED: {result['failure']}")
    print(f"[{time.strftime('%H:%M:%S')}] {result['protocol']} concurrency {result['concurrency']}: {numbers}",
          file=sys.stderr, flush=True)


def markdown(results: list[dict], args) -> str:
    def ms(value: float | None) -> str:
        return "" if value is None else f"{value:.2f}"

    lines = [f"perf_analyzer on {args.model}: batch {args.batch_size} per request, input {args.input_data}, "
             f"{args.measurement_interval_ms} ms windows", "",
             "| protocol | concurrency | infer/s | p50 ms | p95 ms | p99 ms | errors | stable on | failure |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in results:
        throughput = "" if r["throughput"] is None else f"{r['throughput']:.0f}"
        lines.append(f"| {r['protocol']} | {r['concurrency']} | {throughput} | {ms(r['p50_ms'])} | "
                     f"{ms(r['p95_ms'])} | {ms(r['p99_ms'])} | {r['errors']} | {r['stable_on']} | {r['failure'] or ''} |")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DeployKitError as error:  # perf_analyzer cannot be fetched: its one-line message
        sys.exit(f"perf_analyzer: {error}")
