"""Compares benchmark tables of two builds run alternately (benchmarks/ab_device.sh).

    python benchmarks/compare_ab.py --base base_1.json base_2.json --new new_1.json new_2.json

Prints, per row, the median "ours us" of each build over its rounds and new / base: a change
inside the run-to-run spread (about 1-2% on the H200) is no change.
"""

from __future__ import annotations

import argparse
import json
import statistics

TIME_COLUMN = "ours us"


def medians(paths: list[str]) -> dict[tuple[str, ...], float]:
    """Median time of each row (keyed by its leading label columns) over the given runs."""
    times: dict[tuple[str, ...], list[float]] = {}
    for path in paths:
        with open(path) as f:
            table = json.load(f)
        at = table["header"].index(TIME_COLUMN)
        for row in table["rows"]:
            times.setdefault(tuple(row[:at]), []).append(float(row[at]))
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", nargs="+", required=True, help="tables of the base build")
    parser.add_argument("--new", nargs="+", required=True, help="tables of the new build")
    args = parser.parse_args()
    base, new = medians(args.base), medians(args.new)
    print(f"Median of {len(args.base)} base and {len(args.new)} new runs.\n")
    print("| row | base us | new us | new / base |")
    print("|---|---|---|---|")
    for key, base_us in base.items():
        if key in new:
            print(f"| {' '.join(key)} | {base_us:.1f} | {new[key]:.1f} | {new[key] / base_us:.3f} |")


if __name__ == "__main__":
    main()
