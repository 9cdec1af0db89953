"""The servers x concurrency table of benchmarks/run_issue25_device.sh (or of any folder laid out
as it lays them out: ``SERVER-MODEL/cLEVEL/perf_analyzer.json`` and ``busy.txt``), and a
throughput-against-p99 plot of it. Where the servers were measured in several rounds, one after
the other (``roundN/SERVER-MODEL/...``, ROUNDS=N), each number is the median over the rounds and the
table shows the rounds' lowest and highest throughput: on a noisy machine one round proves little.
Where a level has the server's metrics before and after it (``metrics-before.txt``, ``metrics-after.txt``:
serve_metrics.py), a second table says where its time went: rows per run, queue wait, run, time in the server.

Usage: python benchmarks/summarize_issue25.py RESULTS [--plot FILE.png]   (markdown on stdout)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from serve_metrics import KEYS, level_breakdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--plot", type=Path, help="default: RESULTS/throughput_p99.png")
    args = parser.parse_args()
    rows = collect(args.results)
    print(table(rows))
    if any(row.get("inside") for row in rows):
        print()
        print(inside_table(rows))
    if rows:
        plot(rows, args.plot or args.results / "throughput_p99.png")


def collect(results: Path) -> list[dict]:
    """One row per server, model and concurrency level: of the one run, or the medians over ``round*/``."""
    rounds = sorted(path for path in results.glob("round*") if path.is_dir())
    if not rounds:
        return collect_run(results)
    measured: dict[tuple, list[dict]] = {}
    for folder in rounds:
        for row in collect_run(folder):
            measured.setdefault((row["server"], row["model"], row["protocol"], row["concurrency"]), []).append(row)
    return [median_row(found) for found in measured.values()]


def median_row(found: list[dict]) -> dict:
    """The median of each number over the rounds that measured one; errors summed; failures kept."""
    def median(rows: list[dict], key: str):
        values = [row[key] for row in rows if row[key] is not None]
        return statistics.median(values) if values else None

    failures = sorted({row["failure"] for row in found if row["failure"]})
    insides = [row["inside"] for row in found if row.get("inside")]
    inside = {key: median(insides, key) for key in KEYS} if insides else None
    throughputs = [row["throughput"] for row in found if row["throughput"]]
    return {**found[0], **{key: median(found, key) for key in ("throughput", "p50_ms", "p95_ms", "p99_ms", "busy")},
            "errors": sum(row["errors"] for row in found), "failure": "; ".join(failures) or None, "inside": inside,
            "spread": (min(throughputs), max(throughputs), len(found)) if throughputs else None}


def collect_run(results: Path) -> list[dict]:
    """One row per server, model and concurrency level of one run, in the order the folders sort."""
    rows = []
    for level_dir in sorted(results.glob("*-*/c*"), key=_order):
        server, model = level_dir.parent.name.split("-", 1)
        report = level_dir / "perf_analyzer.json"
        measured = json.loads(report.read_text())["results"] if report.is_file() else []
        for result in measured:
            rows.append({"server": server, "model": model, **result, "busy": gpu_busy(level_dir / "busy.txt"),
                         "inside": level_breakdown(level_dir)})
    return rows


def _order(path: Path) -> tuple:
    return path.parent.name.split("-", 1)[1], path.parent.name, int(re.sub(r"\D", "", path.name) or 0)


def gpu_busy(samples: Path) -> float | None:
    """Mean of nvidia-smi's utilization samples after the first second (start-up excluded)."""
    if not samples.is_file():
        return None
    values = [float(line) for line in samples.read_text().split() if re.fullmatch(r"\d+(\.\d+)?", line)]
    steady = values[5:] or values
    return sum(steady) / len(steady) if steady else None


def table(rows: list[dict]) -> str:
    def number(value, digits: int = 2) -> str:
        return "" if value is None else f"{value:.{digits}f}"

    rounds = any(r.get("spread") for r in rows)
    lines = ["| model | server | protocol | concurrency | infer/s | p50 ms | p95 ms | p99 ms | errors | GPU busy % | "
             "serve / triton |" + (" infer/s lowest-highest (rounds) |" if rounds else ""),
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if rounds else "")]
    triton = {(r["model"], r["protocol"], r["concurrency"]): r["throughput"] for r in rows if r["server"] == "triton"}
    for r in rows:
        other = triton.get((r["model"], r["protocol"], r["concurrency"]))
        ratio = r["throughput"] / other if r["server"] == "serve" and r["throughput"] and other else None
        lines.append(f"| {r['model']} | {r['server']} | {r['protocol']} | {r['concurrency']} | "
                     f"{number(r['throughput'], 0)} | "
                     f"{number(r['p50_ms'])} | {number(r['p95_ms'])} | {number(r['p99_ms'])} | {r['errors']} | "
                     f"{number(r['busy'], 0)} | {number(ratio)} |" + (_spread(r) if rounds else "")
                     + (f" {r['failure']}" if r["failure"] else "")
                     + (" (windows judged stable on mean latency, not p99)" if r.get("stable_on") == "mean" else ""))
    return "\n".join(lines)


def inside_table(rows: list[dict]) -> str:
    """Where each server's time went at each level (its metrics, over the whole level): the mean rows per run,
    queue wait, run and time in the server, beside the client's p50 (the rest was spent outside)."""
    lines = ["| model | server | protocol | concurrency | rows per run | queue ms | run ms | in server ms | "
             "client p50 ms |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if inside := r.get("inside"):
            cells = " | ".join("" if inside[key] is None else f"{inside[key]:.{1 if key == 'rows_per_run' else 2}f}"
                               for key in KEYS)
            p50 = "" if r["p50_ms"] is None else f"{r['p50_ms']:.2f}"
            lines.append(f"| {r['model']} | {r['server']} | {r['protocol']} | {r['concurrency']} | {cells} | {p50} |")
    return "\n".join(lines)


def _spread(row: dict) -> str:
    if not row.get("spread"):
        return "  |"
    low, high, count = row["spread"]
    return f" {low:.0f}-{high:.0f} ({count}) |"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    models = sorted({r["model"] for r in rows})
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for axis, model in zip(axes[0], models):
        for server, protocol in sorted({(r["server"], r["protocol"]) for r in rows}):
            points = [r for r in rows if r["model"] == model and r["server"] == server and r["protocol"] == protocol
                      and r["throughput"]]
            axis.plot([r["p99_ms"] for r in points], [r["throughput"] for r in points], marker="o",
                      label=f"{server} ({protocol})")
            for r in points:
                axis.annotate(str(r["concurrency"]), (r["p99_ms"], r["throughput"]), fontsize=8,
                              textcoords="offset points", xytext=(4, 4))
        axis.set(title=model, xlabel="p99 latency (ms)", ylabel="inferences / s", xscale="log")
        # milliseconds as plain numbers (1, 2, 5, 10...), not powers of ten whose minor labels overlap
        axis.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        axis.xaxis.set_minor_formatter(ticker.NullFormatter())
        axis.xaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
