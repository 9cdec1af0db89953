"""Load test of ``deploykit serve``: C concurrent clients x R requests each on 127.0.0.1, with
dynamic batching on and off; every answer is checked against ``deploykit run``'s runner on the same input:
"bit-exact" when identical, "wrong" when outside the tolerances the bundle was validated with (a
row run in a padded batch of 32 on a GPU may round differently from the same row run alone).

Each client is a thread with one keep-alive connection sending binary-tensor requests of
``--rows`` rows, drawn from a few seeded inputs whose reference outputs come from the runner
``deploykit run`` makes (on the first device of ``--device``). Each mode starts one server (its log: serve-MODE.log in
``--out``) and runs every ``--clients`` count against it in turn. The run ends by itself (a fixed
number of requests); it fails (exit 1) on any error or wrong answer.

Usage: python benchmarks/serve_load.py BUNDLE [--device cpu|cuda|cuda:N[,...]] [--clients 32[,128...]]
                                       [--requests 200] [--rows 1] [--instances 1] [--workers auto]
                                       [--batching both|on|off]
                                       [--out DIR]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

import numpy as np

from deploykit.errors import DeployKitError
from deploykit.serving import launch

DISTINCT_INPUTS = 4
#: batching on: serve's defaults; off: one request per run.
MODES = {"on": [], "off": ["--max-batch", "1", "--max-delay-ms", "0"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=counts, default=[32], help="concurrent clients, a comma list runs each")
    parser.add_argument("--requests", type=int, default=200, help="per client")
    parser.add_argument("--rows", type=int, default=1, help="rows per request")
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--workers", default="auto", help="serve's HTTP processes (--workers: auto or a count)")
    parser.add_argument("--batching", choices=["both", "on", "off"], default="both")
    parser.add_argument("--out", type=Path, help="write serve_load.md, serve_load.json and the servers' logs here")
    args = parser.parse_args()
    modes = ["on", "off"] if args.batching == "both" else [args.batching]
    with tempfile.TemporaryDirectory(prefix="serve-load-") as work:
        logs = args.out or Path(work)
        logs.mkdir(parents=True, exist_ok=True)
        cases = reference_cases(args.bundle, args.device.split(",")[0], args.rows)
        results = [result for mode in modes for result in run_mode(mode, cases, args, logs / f"serve-{mode}.log")]
    table = markdown(results, args)
    print(table)
    if args.out:
        (args.out / "serve_load.md").write_text(table + "\n")
        (args.out / "serve_load.json").write_text(json.dumps({"machine": machine(args.device), "args": {
            k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))
    failed = [r for r in results if r["errors"] or r["wrong"]]
    return 1 if failed else 0


def counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


class Case(NamedTuple):
    """Seeded random inputs, what ``deploykit run``'s runner gives for them, and the bundle's tolerances."""

    inputs: dict
    outputs: dict
    tolerances: dict


def reference_cases(bundle: Path, device: str, rows: int) -> list[Case]:
    """The reference answers, from the runner ``deploykit run BUNDLE --device DEVICE --inputs X.npz``
    makes (``runtime.load`` with run's defaults), loaded once here rather than once per input:
    a process per input spent most of the device's time limit loading AOTInductor packages."""
    from deploykit import runtime
    from deploykit.validation.compare import bundle_tolerances

    runner = runtime.load(bundle, "auto", device)
    tolerances = bundle_tolerances(runner.bundle)
    cases = []
    with runner:
        for seed in range(DISTINCT_INPUTS):
            inputs = runtime.random_inputs(runner.inputs, rows, seed)
            outputs = {name: np.asarray(value) for name, value in runner.run(inputs).items()}
            cases.append(Case(inputs, outputs, tolerances))
    progress(f"{len(cases)} reference answers from {runner.describe()['backend']} on {device}")
    return cases


def progress(text: str) -> None:
    """A line on stderr as each stage ends: a run cut by a time limit says how far it got."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def request_body(inputs: dict[str, np.ndarray]) -> tuple[bytes, int]:
    """A binary-tensor infer request (the JSON header's length goes in Inference-Header-Content-Length)."""
    from deploykit.serving.protocol import datatype_of

    tensors = [{"name": name, "shape": list(a.shape), "datatype": datatype_of(a.dtype.name),
                "parameters": {"binary_data_size": a.nbytes}} for name, a in inputs.items()]
    header = json.dumps({"inputs": tensors, "parameters": {"binary_data_output": True}}).encode()
    return header + b"".join(np.ascontiguousarray(a).tobytes() for a in inputs.values()), len(header)


def parse_response(body: bytes, header_length: int) -> dict[str, np.ndarray]:
    from deploykit.backends.base.feeds import numpy_dtype
    from deploykit.serving.protocol import NUMPY_NAMES

    header, offset, outputs = json.loads(body[:header_length]), header_length, {}
    for entry in header["outputs"]:
        size = entry["parameters"]["binary_data_size"]
        dtype = numpy_dtype(NUMPY_NAMES[entry["datatype"]])
        outputs[entry["name"]] = np.frombuffer(body, dtype, count=size // dtype.itemsize,
                                               offset=offset).reshape(entry["shape"])
        offset += size
    return outputs


def client(port: int, model: str, bodies: list, cases: list, count: int, index: int, record: dict) -> None:
    """One client: ``count`` requests on one connection, latencies and failures into ``record``."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    latencies, errors, wrong, exact = [], 0, 0, 0
    for i in range(count):
        case = (index + i) % len(cases)
        body, header_length = bodies[case]
        start = time.perf_counter()
        try:
            connection.request("POST", f"/v2/models/{model}/infer", body,
                               {"Inference-Header-Content-Length": str(header_length)})
            response = connection.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException):
            errors += 1
            connection.close()
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            continue
        latencies.append(time.perf_counter() - start)
        if response.status != 200:
            errors += 1
            continue
        got = parse_response(payload, int(response.getheader("Inference-Header-Content-Length")))
        exact += is_exact(got, cases[case])
        wrong += not within_tolerance(got, cases[case])
    connection.close()
    record[index] = {"latencies": latencies, "errors": errors, "wrong": wrong, "exact": exact}


def is_exact(got: dict, case: Case) -> bool:
    return all(np.array_equal(got[name], case.outputs[name]) for name in case.outputs)


def within_tolerance(got: dict, case: Case) -> bool:
    from deploykit.validation.compare import compare_output

    return all(compare_output(name, expected, got[name], case.tolerances[name]).passed
               for name, expected in case.outputs.items())


def batch_stats(port: int, model: str) -> tuple[float, float]:
    """(runs, rows run) so far, from the server's batch-size histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
        text = response.read().decode()
    families = [f for f in text_string_to_metric_families(text) if f.name == "deploykit_batch_size"]
    values = {s.name: s.value for family in families for s in family.samples
              if s.labels.get("model") == model and s.name.endswith(("_sum", "_count"))}
    return values.get("deploykit_batch_size_count", 0.0), values.get("deploykit_batch_size_sum", 0.0)


def run_mode(mode: str, cases: list, args, log: Path) -> list[dict]:
    """One server with batching ``mode``, warmed up, then each ``--clients`` count in turn."""
    model = args.bundle.resolve().name
    serve_args = [args.bundle, "--device", args.device, "--instances", args.instances, "--workers", args.workers,
                  "--no-access-log", "--max-queue", "4096", *MODES[mode]]
    try:
        with launch.running_server(serve_args, log, startup_s=120) as server:
            bodies = [request_body(case.inputs) for case in cases]
            progress(f"server with batching {mode} ready")
            client(server.port, model, bodies, cases, 20, 0, {})  # warm-up: sessions, allocators, connections
            results = []
            for clients in args.clients:
                results.append({"mode": f"batching {mode}", **timed_load(server.port, model, bodies, cases, clients,
                                                                          args)})
                progress(f"batching {mode}, {clients} clients: {results[-1]['throughput']:.0f} requests/s")
            server.stop(60)
    except RuntimeError as error:  # the server exited or was not ready: its log says why
        raise SystemExit(str(error)) from None
    return results


def timed_load(port: int, model: str, bodies: list, cases: list, clients: int, args) -> dict:
    """``clients`` threads of ``--requests`` requests each; throughput, latencies and batches while they ran."""
    warm_runs, warm_rows = batch_stats(port, model)
    record: dict = {}
    threads = [threading.Thread(target=client, args=(port, model, bodies, cases, args.requests, i, record))
               for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    runs, rows = batch_stats(port, model)
    latencies = np.array([x for r in record.values() for x in r["latencies"]])
    total = clients * args.requests
    return {"clients": clients, "requests": total, "seconds": seconds, "throughput": total / seconds,
            "rows_per_s": total * args.rows / seconds, "p50_ms": float(np.percentile(latencies, 50) * 1e3),
            "p99_ms": float(np.percentile(latencies, 99) * 1e3), "runs": runs - warm_runs,
            "mean_batch": (rows - warm_rows) / max(runs - warm_runs, 1),
            "errors": sum(r["errors"] for r in record.values()), "wrong": sum(r["wrong"] for r in record.values()),
            "exact": sum(r["exact"] for r in record.values())}


def machine(device: str) -> str:
    if device.startswith("cuda"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, check=True).stdout.splitlines()
            return f"{len(names)} x {names[0]}, {os.cpu_count()} CPU cores"
        except (OSError, subprocess.CalledProcessError, IndexError):
            return f"{device}, {os.cpu_count()} CPU cores"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores"


def markdown(results: list[dict], args) -> str:
    lines = [f"{args.bundle.name} on {args.device} ({machine(args.device)}): each client {args.requests} requests "
             f"of {args.rows} row(s), {args.instances} instance(s), --workers {args.workers}", "",
             "| mode | clients | requests/s | rows/s | p50 ms | p99 ms | runs | mean rows/run | errors | wrong | "
             "bit-exact |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['clients']} | {r['throughput']:.0f} | {r['rows_per_s']:.0f} | "
                     f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['runs']:.0f} | {r['mean_batch']:.2f} | "
                     f"{r['errors']} | {r['wrong']} | {r['exact']}/{r['requests']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DeployKitError as error:  # a bundle that does not open or run: its one-line message
        sys.exit(f"serve_load: {error}")
