"""Whether two serve instances on one GPU would gain from a CUDA stream each: two threads, each
copying one row in (page-locked), replaying a CUDA graph of matmuls, and copying a few values out
(a blocking copy, which waits for its stream), with a little host time between runs; first both on
the device's default stream (as ``deploykit serve``'s instance threads run today), then each on a
stream of its own, alternating. Prints runs a second, the median time of one run, and the graph's
time alone.

    python benchmarks/probe_instance_streams.py [--seconds 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="default stream, then own streams, this many times")
    args = parser.parse_args()
    import torch

    device = torch.device("cuda:0")
    for _ in range(args.rounds):
        for own in (False, True):
            graphs = [_captured(torch, device) for _ in range(2)]
            times: list[list[float]] = [[], []]
            stop = threading.Event()
            threads = [threading.Thread(target=_serve, args=(torch, device, own, graphs[i], times[i], stop))
                       for i in range(2)]
            for thread in threads:
                thread.start()
            time.sleep(args.seconds)
            stop.set()
            for thread in threads:
                thread.join()
            runs = times[0] + times[1]
            print(f"{'a stream each' if own else 'default stream'}: {len(runs) / args.seconds:.0f} runs/s, median run "
                  f"{statistics.median(runs) * 1e3:.2f} ms, graph alone {_alone(torch, graphs[0][2]):.2f} ms", flush=True)


def _captured(torch, device):
    """A CUDA graph of 40 fp16 matmuls over 32 rows, its input and its output."""
    x = torch.randn(32, 1024, 256, device=device, dtype=torch.float16)
    w = torch.randn(256, 256, device=device, dtype=torch.float16)

    def forward():
        y = x
        for _ in range(40):
            y = torch.relu(y @ w)
        return y

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        forward()  # warm-up outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = forward()
    torch.cuda.synchronize()
    return x, y, graph


def _serve(torch, device, own: bool, captured, times: list[float], stop: threading.Event) -> None:
    x, y, graph = captured
    row_in = torch.randn(1, 1024, 256).half().pin_memory()
    row_out = torch.empty(1, 4, 256, dtype=torch.float16).pin_memory()
    stream = torch.cuda.Stream(device) if own else torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        while not stop.is_set():
            started = time.perf_counter()
            x[:1].copy_(row_in, non_blocking=True)
            graph.replay()
            row_out.copy_(y[:1, :4])
            time.sleep(0.0003)  # the host's share of a run: splitting, answering
            times.append(time.perf_counter() - started)


def _alone(torch, graph) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / 50 * 1e3


if __name__ == "__main__":
    main()
