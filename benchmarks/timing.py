"""Timing helpers shared by the benchmarks: CUDA events around CUDA-graph replays.

``graph_time_us(calls)`` captures the calls (closures, each on its own input set) in one CUDA
graph, cycling through them, replays it once to warm up, then times ``repeats`` replays with CUDA
events and returns the median time per call in microseconds. Input sets rotate so that the data
one replay touches is several times the L2 cache: repeated calls do not measure the cache.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess

import torch


def l2_bytes() -> int:
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))


def rotation(bytes_per_set: int, at_least: int = 1, most: int = 128) -> int:
    """How many input sets make 3x the L2 cache (at least `at_least`)."""
    return max(at_least, min(most, math.ceil(3 * l2_bytes() / max(bytes_per_set, 1))))


def graph_time_us(calls, inner: int | None = None, repeats: int = 15,
                  warm_ms: float = 0.0) -> float:
    inner = inner or max(len(calls), 8)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager warm-up: lazy initialisation stays out of the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k in range(inner):
            calls[k % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    if warm_ms > 0:  # keep the GPU busy until its clocks have settled
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        while True:
            graph.replay()
            end.record()
            end.synchronize()
            if start.elapsed_time(end) >= warm_ms:
                break
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / inner)
    del graph
    torch.cuda.synchronize()
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), 1 GiB buffers.

    The copy is an elementwise kernel (torch.mul by 1, out=): a plain copy_ inside a CUDA graph
    becomes a memcpy node, which measured only ~2.8 TB/s on the H200 here.
    """
    n = (1 << 30) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    us = graph_time_us([lambda: torch.mul(src, 1.0, out=dst)], inner=10, repeats=21,
                       warm_ms=500.0)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 4 / (us * 1e-6)


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        driver = "?"
    try:
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True,
                              timeout=20).stdout.strip().splitlines()[-1]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        nvcc = "?"
    return {"gpu": torch.cuda.get_device_name(), "sms": props.multi_processor_count,
            "l2_mb": l2_bytes() / 2**20, "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "nvcc": nvcc}


def write_outputs(path: str | None, title: str, env: dict, header: list[str], rows: list[list],
                  extra: dict | None = None) -> str:
    """Markdown table (returned, and written to `path` with a JSON twin if given)."""
    lines = [f"## {title}", "", "environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    if path:
        with open(path, "w") as f:
            f.write(text)
        with open(path.rsplit(".", 1)[0] + ".json", "w") as f:
            json.dump({"env": env, "header": header, "rows": rows, **(extra or {})}, f, indent=1)
    return text
