"""Where a process's Python time went, from py-spy's raw output (``py-spy record --format raw``: one
line per distinct stack, frames joined by ';', then its sample count): the frames most often on top
of the stack (own time), then the frames most often anywhere on it (inclusive time). Used on the
profiles run_issue25_device.sh takes with PROFILE_LEVEL.

    python benchmarks/py_spy_summary.py PY-SPY-RAW.txt [--top 20]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    own, inclusive, total = collections.Counter(), collections.Counter(), 0
    for line in args.raw.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    print(f"{total} samples\n\nown time:")
    for frame, count in own.most_common(args.top):
        print(f"{count:6d} {100 * count / total:5.1f} %  {frame}")
    print("\ninclusive time:")
    for frame, count in inclusive.most_common(args.top):
        print(f"{count:6d} {100 * count / total:5.1f} %  {frame}")


if __name__ == "__main__":
    main()
