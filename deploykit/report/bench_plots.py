"""Plots for ``deploykit bench`` and ``deploykit profile``, as PNG bytes."""

from __future__ import annotations

import numpy as np

from deploykit.report.figures import plt, png_bytes

CUSTOM_COLOUR, OTHER_COLOUR = "#d62728", "#1f77b4"


def bench_png(bench: dict) -> bytes:
    """Left: p50 latency per batch size (bars; whiskers up to p99; each labelled with its ratio to
    torch.compile(mode="reduce-overhead") in the same precision). Right: throughput."""
    measured = [c for c in bench["contenders"] if c["results"]]
    batches = sorted({r["batch"] for c in measured for r in c["results"]})
    figure, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    width = 0.8 / max(1, len(measured))
    for index, contender in enumerate(measured):
        by_batch = {r["batch"]: r for r in contender["results"]}
        xs = [i + (index - (len(measured) - 1) / 2) * width for i, b in enumerate(batches) if b in by_batch]
        rows = [by_batch[b] for b in batches if b in by_batch]
        p50 = [r["p50_ms"] for r in rows]
        spread = [[0] * len(rows), [max(0.0, r["p99_ms"] - r["p50_ms"]) for r in rows]]  # p50: of round medians
        latency.bar(xs, p50, width, yerr=spread, capsize=2, label=contender["label"])
        for x, row in zip(xs, rows):  # the ratio to torch.compile(mode="reduce-overhead") in the same precision
            if row.get("vs_reduce_overhead") is not None:
                latency.annotate(f"{row['vs_reduce_overhead']:.2f}x", (x, row["p50_ms"]), ha="center",
                                 va="bottom", fontsize=5, rotation=90)
        throughput.plot([b for b in batches if b in by_batch], [r["throughput"] for r in rows], marker="o",
                        label=contender["label"])
    latency.set_xticks(range(len(batches)), [str(b) for b in batches])
    latency.set_xlabel("batch size")
    latency.set_ylabel("latency p50 (ms); whisker: p99; label: vs reduce-overhead")
    latency.set_title(f"latency on {bench['device']}", fontsize=10)
    if len(batches) > 1 and batches[-1] / batches[0] >= 4:
        throughput.set_xscale("log", base=2)
    throughput.set_xticks(batches, [str(b) for b in batches])
    throughput.minorticks_off()
    throughput.set_xlabel("batch size")
    throughput.set_ylabel("samples / s")
    throughput.set_title("throughput (batch / mean latency)", fontsize=10)
    if measured:
        throughput.legend(fontsize=7)
    return png_bytes(figure)


def cost_bars_png(rows: list[dict], labels: list[str], title: str) -> bytes:
    """Horizontal bars of the costliest rows (ms per run), deploykit's ops in red, costliest on top."""
    rows, labels = rows[::-1], labels[::-1]
    figure, axes = plt.subplots(figsize=(9, 0.28 * len(rows) + 1.2), dpi=110)
    colours = [CUSTOM_COLOUR if row["custom"] else OTHER_COLOUR for row in rows]
    axes.barh(labels, [row["per_run_ms"] for row in rows], color=colours)
    axes.set_xlabel("ms per run; red: deploykit ops")
    axes.set_title(title, fontsize=10)
    axes.tick_params(axis="y", labelsize=7)
    return png_bytes(figure)


def timeline_png(events: list[dict], title: str) -> bytes:
    """One run's layers along time (start, duration in µs), one row per op type."""
    types = sorted({e["op_type"] for e in events})
    figure, axes = plt.subplots(figsize=(11, 0.3 * len(types) + 1.4), dpi=110)
    start = min((e["start_us"] for e in events), default=0)
    for event in events:
        row = types.index(event["op_type"])
        colour = CUSTOM_COLOUR if event["custom"] else OTHER_COLOUR
        axes.broken_barh([(event["start_us"] - start, max(event["duration_us"], 0.5))], (row - 0.4, 0.8),
                         facecolors=colour)
    axes.set_yticks(np.arange(len(types)), types, fontsize=7)
    axes.set_xlabel("time since the run started (µs); red: deploykit ops")
    axes.set_title(title, fontsize=10)
    return png_bytes(figure)
