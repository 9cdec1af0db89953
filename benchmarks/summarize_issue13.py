"""The issue-13 table from run_issue13_device.sh's bench.json files: per model, precision and batch,
eager PyTorch, torch.compile(mode="reduce-overhead"), deploykit.load(bundle) (what users get), the
AOTInductor packages and
ONNX Runtime's floor (a hand-written IOBinding + CUDA graph) beside our runner, p50 ms.

    python benchmarks/summarize_issue13.py RESULTS_FOLDER > summary.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: column -> bench key, by the bundle's precision; an fp8 bundle is measured against PyTorch fp16
#: (its ONNX graph is fp16, its packages' Linear products fp8), an int8 one (a Q/DQ graph) against fp32
PRECISIONS = ("fp32", "fp16", "fp8", "int8")
COLUMNS = {
    "eager": {"fp32": "pytorch", "fp16": "pytorch-fp16", "fp8": "pytorch-fp16", "int8": "pytorch"},
    "reduce-overhead": {"fp32": "reduce-overhead", "fp16": "reduce-overhead-fp16", "fp8": "reduce-overhead-fp16",
                        "int8": "reduce-overhead"},
    **{column: dict.fromkeys(PRECISIONS, key) for column, key in (
        ("deploykit.load", "deploykit-load"), ("AOTI static", "aoti-static"), ("ORT runner", "ort-deploykit"),
        ("ORT floor", "ort-cuda-graph"))},
}


def p50(entries: dict, key: str, batch: int) -> float | None:
    rows = [r for r in entries.get(key, {}).get("results", []) if r["batch"] == batch]
    return rows[0]["p50_ms"] if rows else None


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "–"


def main(folder: Path) -> None:
    print("| model | precision | batch | " + " | ".join(COLUMNS) +
          " | reduce-overhead / load (≥ 1: we are faster) | eager / load | runner / floor |")
    print("|" + " --- |" * (len(COLUMNS) + 6))
    for path in sorted(folder.glob("*/bench.json")):
        model, _, precision = path.parent.name.rpartition("-")
        bench = json.loads(path.read_text())
        entries = {e["key"]: e for e in bench["contenders"]}
        for batch in sorted({r["batch"] for e in entries.values() for r in e["results"]}):
            ms = {column: p50(entries, keys[precision], batch) for column, keys in COLUMNS.items()}
            cells = " | ".join(f"{v:.3f}" if v else "–" for v in ms.values())
            print(f"| {model} | {precision} | {batch} | {cells} | {ratio(ms['reduce-overhead'], ms['deploykit.load'])} | "
                  f"{ratio(ms['eager'], ms['deploykit.load'])} | {ratio(ms['ORT runner'], ms['ORT floor'])} |")
    failed = [(p.parent.name, e["key"], e["reason"]) for p in sorted(folder.glob("*/bench.json"))
              for e in json.loads(p.read_text())["contenders"] if e["status"] == "failed"]
    for name, key, reason in failed:
        print(f"\n- {name}: {key} failed: {reason}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
