"""Where a request's time goes inside ``deploykit serve``, from two snapshots of its ``/metrics``.

A load generator sees one latency per request. The server's own histograms split it: time waiting in the
queue for a batch, the run of that batch (rows gathered, model, outputs back on the host), and the whole
request inside the server (body received to answer ready). What is left of the client's latency was spent
outside: in the client, on the wire, and in the HTTP server before the body was complete and after the
answer was ready. The mean batch size says whether the batches filled.

    python benchmarks/serve_metrics.py snapshot URL FILE        # /metrics of URL (http://host:port) into FILE
    python benchmarks/serve_metrics.py compare BEFORE AFTER     # the breakdown of what happened in between

run_issue25_device.sh takes a snapshot before and after each of serve's concurrency levels, and
summarize_issue25.py puts the breakdown beside perf_analyzer's latencies.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

#: Histograms of deploykit serve: (the name in the breakdown, the metric, milliseconds or plain).
HISTOGRAMS = (("rows_per_run", "deploykit_batch_size", False),
              ("queue_ms", "deploykit_queue_latency_seconds", True),
              ("run_ms", "deploykit_run_latency_seconds", True),
              ("in_server_ms", "deploykit_request_latency_seconds", True))


def totals(text: str) -> dict[str, tuple[float, float]]:
    """Each histogram's (sum, count) over every model and label, from Prometheus' text format."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for suffix, index in (("_sum", 0), ("_count", 1)):
                if sample.name.endswith(suffix):
                    found.setdefault(sample.name.removesuffix(suffix), [0.0, 0.0])[index] += sample.value
    return {name: (sums, count) for name, (sums, count) in found.items()}


def breakdown(before: str, after: str) -> dict[str, float | None]:
    """The mean of each histogram over what was observed between the two snapshots (None: nothing was),
    and ``requests``: how many were answered in between."""
    first, second = totals(before), totals(after)
    answered = (second.get("deploykit_request_latency_seconds", (0.0, 0.0))[1]
                - first.get("deploykit_request_latency_seconds", (0.0, 0.0))[1])
    means: dict[str, float | None] = {"requests": answered}
    for key, metric, seconds in HISTOGRAMS:
        sums, count = (b - a for a, b in zip(first.get(metric, (0.0, 0.0)), second.get(metric, (0.0, 0.0))))
        means[key] = None if count <= 0 else sums / count * (1e3 if seconds else 1)
    return means


def level_breakdown(level_dir: Path) -> dict[str, float | None] | None:
    """The breakdown of one level's folder (``metrics-before.txt``, ``metrics-after.txt``), else None."""
    before, after = level_dir / "metrics-before.txt", level_dir / "metrics-after.txt"
    if not (before.is_file() and after.is_file()):
        return None
    return breakdown(before.read_text(), after.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    snapshot = commands.add_parser("snapshot", help="save URL/metrics into FILE")
    snapshot.add_argument("url")
    snapshot.add_argument("file", type=Path)
    compare = commands.add_parser("compare", help="the breakdown between two snapshots, as JSON")
    compare.add_argument("before", type=Path)
    compare.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "snapshot":
        with urllib.request.urlopen(f"{args.url.rstrip('/')}/metrics", timeout=30) as answer:
            args.file.write_bytes(answer.read())
    else:
        print(json.dumps(breakdown(args.before.read_text(), args.after.read_text()), indent=1))


if __name__ == "__main__":
    main()
