"""The issue-16 tables from run_issue16_device.sh's results: ``deploykit serve`` under load on one
GPU and on two (serve-<N>gpu/serve_load.json), and ``deploykit bench`` of deploykit.load on one GPU
alone (bench-alone/bench.json) beside one per GPU at once (bench-gpu<K>/bench.json).

    python benchmarks/summarize_issue16.py RESULTS_FOLDER > summary.md
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def serve_rows(folder: Path) -> list[dict]:
    """serve_load's results, each with the GPUs its server ran on."""
    rows = []
    for path in folder.glob("serve-*gpu/serve_load.json"):
        gpus = int(re.fullmatch(r"serve-(\d+)gpu", path.parent.name).group(1))
        rows += [{"gpus": gpus, **result} for result in json.loads(path.read_text())["results"]]
    return sorted(rows, key=lambda r: (r["mode"], r["clients"], r["gpus"]))


def serve_table(rows: list[dict]) -> list[str]:
    one_gpu = {(r["mode"], r["clients"]): r["throughput"] for r in rows if r["gpus"] == 1}
    lines = ["| mode | clients | GPUs | requests/s | vs 1 GPU | p50 ms | p99 ms | mean rows/run | errors | wrong |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        base = one_gpu.get((r["mode"], r["clients"]))
        scale = f"{r['throughput'] / base:.2f}" if base else "–"
        lines.append(f"| {r['mode']} | {r['clients']} | {r['gpus']} | {r['throughput']:.0f} | {scale} | "
                     f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['mean_batch']:.2f} | {r['errors']} | {r['wrong']} |")
    return lines


def bench_table(folder: Path) -> list[str]:
    """deploykit.load's p50 and throughput per batch: GPU 0 alone, then every GPU at once."""
    lines = ["| run | batch | p50 ms | p99 ms | samples/s |", "| --- | ---: | ---: | ---: | ---: |"]
    for path in sorted(folder.glob("bench-*/bench.json")):
        contender = next(c for c in json.loads(path.read_text())["contenders"] if c["key"] == "deploykit-load")
        run = path.parent.name.removeprefix("bench-")
        label = "GPU 0 alone" if run == "alone" else f"GPU {run.removeprefix('gpu')}, all GPUs at once"
        if contender["status"] != "ok":
            lines.append(f"| {label} | – | {contender['status']}: {contender['reason']} | | |")
        for result in contender["results"]:
            lines.append(f"| {label} | {result['batch']} | {result['p50_ms']:.3f} | {result['p99_ms']:.3f} | "
                         f"{result['throughput']:.0f} |")
    return lines


def main(folder: Path) -> None:
    print("## deploykit serve: one instance per GPU\n")
    print("\n".join(serve_table(serve_rows(folder))))
    print("\n## deploykit bench (deploykit.load), one process per GPU\n")
    print("\n".join(bench_table(folder)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
