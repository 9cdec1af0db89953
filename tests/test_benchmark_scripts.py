"""Every command-line script in benchmarks/ runs its main: a script whose ``--help`` prints no usage
would do nothing on the GPU machine and still exit 0 (it happened, costing a device call)."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(path for path in BENCHMARKS.glob("*.py") if "argparse" in path.read_text())


def test_the_benchmark_scripts_are_found():
    assert {"profile_runner_call.py", "serve_load.py", "probe_aoti_configs.py"} <= {path.name for path in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_benchmark_script_answers_help_with_its_usage(script):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: " + script.name)


def test_the_serve_against_triton_summary_pairs_levels_and_plots(tmp_path):
    """summarize_issue25.py: each serve row divided by Triton's at the same model, protocol and concurrency,
    a level without numbers kept with its failure, GPU busy from the samples after the first second."""
    import json

    def level(server, concurrency, throughputs, failure=None, busy=None):
        """One level's folder; ``throughputs``: by protocol, each protocol's run of perf_analyzer."""
        folder = tmp_path / f"{server}-resnet50" / f"c{concurrency}"
        folder.mkdir(parents=True)
        results = [{"protocol": protocol, "concurrency": concurrency, "throughput": throughput, "p50_ms": 1.0,
                    "p95_ms": 2.0, "p99_ms": 3.0, "errors": 0 if failure is None else 2, "failure": failure}
                   for protocol, throughput in throughputs.items()]
        (folder / "perf_analyzer.json").write_text(json.dumps({"results": results}))
        if busy:
            (folder / "busy.txt").write_text("\n".join(map(str, busy)))

    level("serve", 16, {"http": 3000.0, "grpc": 2000.0}, busy=[0, 0, 0, 0, 0, 90, 80])
    level("triton", 16, {"http": 1000.0, "grpc": 4000.0})
    level("serve", 128, {"http": None}, failure="Thread [0] had error")
    level("triton", 128, {"http": 1200.0})
    done = subprocess.run([sys.executable, str(BENCHMARKS / "summarize_issue25.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| resnet50")]
    assert rows[0] == "| resnet50 | serve | http | 16 | 3000 | 1.00 | 2.00 | 3.00 | 0 | 85 | 3.00 |"
    assert rows[1] == "| resnet50 | serve | grpc | 16 | 2000 | 1.00 | 2.00 | 3.00 | 0 | 85 | 0.50 |"  # against gRPC
    assert rows[2].startswith("| resnet50 | serve | http | 128 |  |") and rows[2].endswith("| 2 |  |  | Thread [0] had error")
    assert (tmp_path / "throughput_p99.png").stat().st_size > 0


def metrics_text(observed: dict[str, tuple[float, float]]) -> str:
    """Prometheus' text format of deploykit serve's histograms: ``{metric: (sum, count)}``, as two workers'
    label sets (the multiprocess mode's sum is what ``/metrics`` shows, one series per label set)."""
    lines = []
    for metric, (total, count) in observed.items():
        lines += [f"# HELP {metric} h", f"# TYPE {metric} histogram"]
        for model, share in (("a", 0.25), ("b", 0.75)):
            lines += [f'{metric}_bucket{{le="+Inf",model="{model}"}} {count * share}',
                      f'{metric}_count{{model="{model}"}} {count * share}',
                      f'{metric}_sum{{model="{model}"}} {total * share}']
    return "\n".join(lines) + "\n"


def test_where_serves_time_goes_between_two_snapshots(tmp_path):
    """serve_metrics.py and summarize_issue25.py: the means of what serve's histograms observed during a level
    (differences of sums over differences of counts, every label summed), in a second table; a level
    without snapshots, or where nothing was observed, has none."""
    import json

    before = metrics_text({"deploykit_batch_size": (100, 10), "deploykit_queue_latency_seconds": (0.1, 100),
                           "deploykit_run_latency_seconds": (0.05, 10),
                           "deploykit_request_latency_seconds": (0.5, 100)})
    after = metrics_text({"deploykit_batch_size": (740, 30), "deploykit_queue_latency_seconds": (1.38, 740),
                          "deploykit_run_latency_seconds": (0.15, 30), "deploykit_request_latency_seconds": (6.9, 740)})
    for concurrency, snapshots in ((64, (before, after)), (128, (after, after)), (256, None)):
        folder = tmp_path / "serve-resnet50" / f"c{concurrency}"
        folder.mkdir(parents=True)
        result = {"protocol": "http", "concurrency": concurrency, "throughput": 5000.0, "p50_ms": 12.5, "p95_ms": 20.0,
                  "p99_ms": 30.0, "errors": 0, "failure": None}
        (folder / "perf_analyzer.json").write_text(json.dumps({"results": [result]}))
        if snapshots:
            (folder / "metrics-before.txt").write_text(snapshots[0])
            (folder / "metrics-after.txt").write_text(snapshots[1])
    compared = subprocess.run([sys.executable, str(BENCHMARKS / "serve_metrics.py"), "compare",
                               str(tmp_path / "serve-resnet50/c64/metrics-before.txt"),
                               str(tmp_path / "serve-resnet50/c64/metrics-after.txt")],
                              capture_output=True, text=True, timeout=300)
    assert compared.returncode == 0, compared.stderr
    assert json.loads(compared.stdout) == pytest.approx({"requests": 640, "rows_per_run": 32.0, "queue_ms": 2.0,
                                                          "run_ms": 5.0, "in_server_ms": 10.0})
    done = subprocess.run([sys.executable, str(BENCHMARKS / "summarize_issue25.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    inside = done.stdout.split("| model | server | protocol | concurrency | rows per run |")[1].splitlines()
    assert inside[2:] == ["| resnet50 | serve | http | 64 | 32.0 | 2.00 | 5.00 | 10.00 | 12.50 |",
                          "| resnet50 | serve | http | 128 |  |  |  |  | 12.50 |"]


def test_where_tritons_time_goes_from_its_counters():
    """Triton's metrics: microseconds summed over requests (compute input, infer and output make the run,
    which each request of a batch counts once), rows per run from inferences over executions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_metrics", BENCHMARKS / "serve_metrics.py")
    serve_metrics = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_metrics)

    def triton(requests, runs, queue_us, compute_us, total_us):
        lines = []
        for name, value in (("nv_inference_request_success", requests), ("nv_inference_count", requests),
                            ("nv_inference_exec_count", runs), ("nv_inference_queue_duration_us", queue_us),
                            ("nv_inference_compute_input_duration_us", compute_us[0]),
                            ("nv_inference_compute_infer_duration_us", compute_us[1]),
                            ("nv_inference_compute_output_duration_us", compute_us[2]),
                            ("nv_inference_request_duration_us", total_us)):
            lines += [f"# TYPE {name} counter", f'{name}{{model="m",version="1"}} {value}']
        return "\n".join(lines) + "\n"

    before = triton(100, 20, 1_000, (100, 5_000, 200), 9_000)
    after = triton(900, 120, 801_000, (500, 1_204_000, 800), 2_409_000)
    assert serve_metrics.breakdown(before, after) == pytest.approx(
        {"requests": 800, "rows_per_run": 8.0, "queue_ms": 1.0, "run_ms": 1.5, "in_server_ms": 3.0})
    assert serve_metrics.breakdown(after, after)["run_ms"] is None


def test_the_summary_of_several_rounds_takes_medians(tmp_path):
    """ROUNDS=N: each number is the median over the rounds, with the throughput's range and count."""
    import json

    for index, (serve, triton) in enumerate([(300.0, 200.0), (100.0, 210.0), (280.0, 190.0)]):
        for server, throughput in (("serve", serve), ("triton", triton)):
            folder = tmp_path / f"round{index + 1}" / f"{server}-tiny" / "c8"
            folder.mkdir(parents=True)
            result = {"protocol": "http", "concurrency": 8, "throughput": throughput, "p50_ms": index + 1.0,
                      "p95_ms": 2.0, "p99_ms": 10.0 * (index + 1), "errors": index, "failure": None}
            (folder / "perf_analyzer.json").write_text(json.dumps({"results": [result]}))
    done = subprocess.run([sys.executable, str(BENCHMARKS / "summarize_issue25.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| tiny")]
    assert rows == ["| tiny | serve | http | 8 | 280 | 2.00 | 2.00 | 20.00 | 3 |  | 1.40 | 100-300 (3) |",
                    "| tiny | triton | http | 8 | 200 | 2.00 | 2.00 | 20.00 | 3 |  |  | 190-210 (3) |"]


def test_perf_analyzer_measures_a_level_whose_p99_never_settles_again_on_mean_latency(tmp_path):
    """perf_analyzer.py: a level perf_analyzer finds unstable on p99 is run again without --percentile
    (judged on mean latency), and its result says so; a stable level runs once."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("perf_analyzer_script", BENCHMARKS / "perf_analyzer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    fake = tmp_path / "fake_perf_analyzer.py"  # unstable whenever it is asked to judge on p99
    fake.write_text("""import sys
args = sys.argv[1:]
if "--percentile=99" in args and "unstable" in args[args.index("-m") + 1]:
    print("Failed to obtain stable measurement within 10 measurement windows")
    sys.exit(0)
with open(args[args.index("-f") + 1], "w") as report:
    report.write("Concurrency,Inferences/Second,p50 latency,p95 latency,p99 latency\\n256,4000,50000,60000,70000\\n")
""")
    program = types.SimpleNamespace(command=[sys.executable, str(fake)], env=None)

    def measure(model):
        args = types.SimpleNamespace(model=model, measurement_interval_ms=100, stability_percentage=10, batch_size=1,
                                     input_data="zero", shape=[], out=tmp_path / model)
        args.out.mkdir()
        return script.measure(program, args, "http", "127.0.0.1:1", 256)

    settled, unsettled = measure("steady"), measure("unstable")
    assert settled["stable_on"] == "p99" and not (tmp_path / "steady" / "http-c256-mean.log").exists()
    assert unsettled["stable_on"] == "mean" and unsettled["failure"] is None
    assert (unsettled["throughput"], unsettled["p99_ms"]) == (4000.0, 70.0)
    assert "Failed to obtain stable measurement" in (tmp_path / "unstable" / "http-c256.log").read_text()


def test_the_model_process_ceiling_drives_the_real_model_process(tmp_path):
    """model_process_ceiling.py: a client process sends requests through HostLink to run_model_process and
    the table counts answered requests; a model process that answered none would print 0 requests/s."""
    import converted_bundles

    bundle = converted_bundles.converted("tabular")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "model_process_ceiling.py"), str(bundle), "--seconds", "1",
                           "--rounds", "1", "--in-flight", "4", "--max-batch", "4"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 1 |"))
    requests_per_second = float(row.split("|")[2].replace(",", ""))
    assert requests_per_second > 10, done.stdout
