"""Where a request's time goes inside ``deploykit serve`` or Triton, from two snapshots of its metrics.

A load generator sees one latency per request. A server's own metrics split it: time waiting in the queue
for a batch, the run of that batch, and the whole request inside the server. What is left of the client's
latency was spent outside: in the client, on the wire, and in the HTTP server before the body was complete
and after the answer was ready. The mean batch size says whether the batches filled. deploykit serve has
histograms (the run: rows gathered, model, outputs back on the host; in the server: body received to answer
ready); Triton has cumulative microseconds per request (the run: its compute input, infer and output, which
every request of a batch counts once; in the server: request received to response sent).

    python benchmarks/serve_metrics.py snapshot URL FILE        # URL/metrics (http://host:port) into FILE
    python benchmarks/serve_metrics.py compare BEFORE AFTER     # the breakdown of what happened in between

run_issue25_device.sh takes a snapshot of each server before and after each concurrency level, and
summarize_issue25.py puts the breakdown beside perf_analyzer's latencies.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

#: The means a breakdown gives, beside ``requests``.
KEYS = ("rows_per_run", "queue_ms", "run_ms", "in_server_ms")
#: deploykit serve's histograms: (the name in the breakdown, the metric, milliseconds or plain).
HISTOGRAMS = (("rows_per_run", "deploykit_batch_size", False),
              ("queue_ms", "deploykit_queue_latency_seconds", True),
              ("run_ms", "deploykit_run_latency_seconds", True),
              ("in_server_ms", "deploykit_request_latency_seconds", True))
#: Triton's counters of microseconds summed over requests, for the same names.
TRITON_TIMES = (("queue_ms", ("nv_inference_queue_duration_us",)),
                ("run_ms", ("nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
                            "nv_inference_compute_output_duration_us")),
                ("in_server_ms", ("nv_inference_request_duration_us",)))
TRITON_REQUESTS = "nv_inference_request_success"


def sums(text: str) -> dict[str, float]:
    """Each sample's value summed over its labels (models, versions), by sample name, from Prometheus' text
    (a counter by its name as written: the parser adds ``_total`` to Triton's)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total") if family.type == "counter" else sample.name
            found[name] = found.get(name, 0.0) + sample.value
    return found


def breakdown(before: str, after: str) -> dict[str, float | None]:
    """``requests`` answered between the two snapshots, and the mean rows per run, queue wait, run and time
    in the server over them (None where nothing was observed), from serve's or Triton's metrics."""
    first, second = sums(before), sums(after)
    delta = {name: value - first.get(name, 0.0) for name, value in second.items()}
    return _triton(delta) if TRITON_REQUESTS in second else _serve(delta)


def _serve(delta: dict[str, float]) -> dict[str, float | None]:
    means: dict[str, float | None] = {"requests": delta.get("deploykit_request_latency_seconds_count", 0.0)}
    for key, metric, seconds in HISTOGRAMS:
        count = delta.get(f"{metric}_count", 0.0)
        means[key] = None if count <= 0 else delta[f"{metric}_sum"] / count * (1e3 if seconds else 1)
    return means


def _triton(delta: dict[str, float]) -> dict[str, float | None]:
    requests, runs = delta.get(TRITON_REQUESTS, 0.0), delta.get("nv_inference_exec_count", 0.0)
    means: dict[str, float | None] = {"requests": requests,
                                      "rows_per_run": delta.get("nv_inference_count", 0.0) / runs if runs > 0 else None}
    for key, counters in TRITON_TIMES:
        means[key] = sum(delta.get(name, 0.0) for name in counters) / requests / 1e3 if requests > 0 else None
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
