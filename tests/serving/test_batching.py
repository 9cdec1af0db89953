"""The batcher in process, on the real runner of the tabular bundle: requests that arrive within
the delay share one run, runs are padded up to a bucket and split back exactly, and closing
answers everything still queued.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("prometheus_client")

import converted_bundles  # noqa: E402

from deploykit.errors import BadInputError  # noqa: E402
from deploykit.serving.batching import Batcher  # noqa: E402
from deploykit.serving.metrics import Metrics  # noqa: E402
from deploykit.serving.models import ServedModel, ServeOptions, load_models  # noqa: E402
from deploykit.serving.protocol import RequestError  # noqa: E402


def served(**options):
    bundle = converted_bundles.converted("tabular")
    return load_models([bundle], ServeOptions(devices=("cpu",), **options))[0]


def rows(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, 13)).astype(np.float32)


def runs_and_rows(metrics: Metrics) -> tuple[float, float]:
    """How many runs there were and how many rows they held, from the batch-size histogram."""
    samples = {s.name: s.value for s in metrics.batch_size.labels("tabular").collect()[0].samples}
    return samples["deploykit_batch_size_count"], samples["deploykit_batch_size_sum"]


def test_requests_within_the_delay_share_one_padded_run():
    model = served(buckets="validated")
    assert model.buckets == [1, 2, 4] and model.max_batch == 4
    metrics = Metrics()
    batcher = Batcher(model, max_delay_s=0.5, max_queue=8, metrics=metrics)
    inputs = [rows(1, 1), rows(2, 2)]  # 3 rows: padded to the bucket 4
    with batcher.arriving():  # the second request is on its way while the first is queued
        futures = [batcher.submit({"features": x}, len(x)) for x in inputs]
    results = [future.result(timeout=10) for future in futures]
    batcher.close()
    padded = np.concatenate([*inputs, np.zeros((1, 13), np.float32)])
    expected = model.runner.run(features=padded)
    np.testing.assert_array_equal(results[0]["output_1"], expected["output_1"][:1])
    np.testing.assert_array_equal(results[1]["output_1"], expected["output_1"][1:3])
    assert runs_and_rows(metrics) == (1, 3)  # one run of 3 rows (padding not counted)


def test_a_request_with_none_on_its_way_runs_without_waiting_out_the_delay():
    model = served()
    batcher = Batcher(model, max_delay_s=30, max_queue=8, metrics=Metrics())
    lone = batcher.submit({"features": rows(1, 6)}, 1)
    assert lone.result(timeout=5)["output_0"].shape == (1, 4)  # not 30 s: nothing could have joined it
    with batcher.arriving():
        waiting = batcher.submit({"features": rows(1, 7)}, 1)
        with pytest.raises(concurrent.futures.TimeoutError):  # another request is being read: the batch waits for it
            waiting.result(timeout=0.5)
    assert waiting.result(timeout=5)["output_0"].shape == (1, 4)  # ... and runs once none is on its way
    batcher.close()


def test_a_full_batch_runs_at_once_and_close_drains_the_queue():
    model = served(max_batch=2)
    metrics = Metrics()
    batcher = Batcher(model, max_delay_s=30, max_queue=8, metrics=metrics)
    full = batcher.submit({"features": rows(2, 3)}, 2)
    assert full.result(timeout=10)["output_0"].shape == (2, 4)  # no 30 s wait: the batch was full
    waiting = batcher.submit({"features": rows(1, 4)}, 1)
    batcher.close()  # does not wait out the delay, and answers the waiting request
    assert waiting.result(timeout=1)["output_0"].shape == (1, 4)
    with pytest.raises(RequestError, match="shutting down"):
        batcher.submit({"features": rows(1, 5)}, 1)


def test_bucket_and_batch_options_are_checked():
    with pytest.raises(BadInputError, match="--max-batch 9 is outside tabular's batch range 1..4"):
        served(max_batch=9)
    with pytest.raises(BadInputError, match="--buckets 2,8: every size must lie in 1..4"):
        served(buckets="2,8")
    assert served(buckets="2").buckets == [2, 4]
    assert served().buckets == []  # auto on a CPU: the rows as they come


def test_a_static_batch_model_refuses_nan_too(tmp_path):
    """NaN is refused before the batch rules, so a bundle without a dynamic batch refuses it as well."""
    import torch

    import model_zoo
    from deploykit_cli import run_deploykit

    torch.save(model_zoo.tabular().state_dict(), tmp_path / "tabular.pt")
    result = run_deploykit("convert", tmp_path / "tabular.pt", "--factory", "model_zoo:tabular", "--input",
                           "features:1x13", "-o", tmp_path / "static")
    assert result.returncode == 0, result.stderr
    model = load_models([tmp_path / "static"], ServeOptions(devices=("cpu",)))[0]
    features = rows(1, seed=3)
    assert model.max_batch == 1 and model.check({"features": features}) == 1
    features[0, 2] = np.nan
    with pytest.raises(RequestError, match="features holds 1 NaN or infinite values"):
        model.check({"features": features})
    allowed = load_models([tmp_path / "static"], ServeOptions(devices=("cpu",), allow_nan=True))[0]
    assert allowed.check({"features": features}) == 1


def test_instances_share_one_verification_of_the_bundle(monkeypatch):
    """Three instances: each bundle file they use is hashed once, not once per instance."""
    import collections

    from deploykit.bundle import read

    bundle = converted_bundles.converted("tabular")
    hashed = collections.Counter()

    def counting(path):
        hashed[path.name] += 1
        return real(path)

    real = read.sha256_of
    monkeypatch.setattr(read, "sha256_of", counting)
    model = load_models([bundle], ServeOptions(devices=("cpu",), instances=3))[0]
    assert len(model.runners) == 3 and hashed["model.onnx"] == 1
    assert set(hashed.values()) == {1}, hashed


class GatedRunner:
    """Doubles its input; each run says how many rows it got and waits for the test's go."""

    inputs = [{"name": "x", "dtype": "float32", "shape": ["batch", 2],
               "dynamic": {"0": {"min": 1, "opt": 2, "max": 4}}}]
    outputs = [{"name": "y", "dtype": "float32", "shape": ["batch", 2]}]
    device = "cpu"

    def __init__(self):
        self.go, self.started = threading.Semaphore(0), queue.Queue()

    def run(self, feeds):
        self.started.put(len(feeds["x"]))
        self.go.acquire()
        return {"y": feeds["x"] * 2}


def test_threads_set_each_instances_onnx_runtime_threads_which_stop_spinning_between_runs():
    model = served(instances=2, threads=1)
    assert [r.session.get_session_options().intra_op_num_threads for r in model.runners] == [1, 1]
    options = served().runner.session.get_session_options()
    assert options.intra_op_num_threads == 0  # ONNX Runtime's default
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"  # the event loop's cores


def test_a_model_names_what_every_instance_noted_once():
    """Instances on other devices may note other things (an engine one GPU cannot run): serve prints them all."""
    runners = [SimpleNamespace(notes=["swapped library", "engine not used on cuda:0"]),
               SimpleNamespace(notes=["swapped library"])]
    model = ServedModel("m", Path("m"), runners, ["cuda:0", "cuda:1"], max_batch=4, buckets=[], allow_nan=False)
    assert model.notes == ["swapped library", "engine not used on cuda:0"]


def test_queued_rows_follow_partial_takes_and_timed_out_requests():
    runner = GatedRunner()
    model = ServedModel("gated", Path("gated"), [runner], ["cpu"], max_batch=4, buckets=[], allow_nan=False)
    batcher = Batcher(model, max_delay_s=0, max_queue=8, metrics=Metrics())

    def submit(n: int):
        return batcher.submit({"x": np.full((n, 2), n, np.float32)}, n)

    answered = {3: submit(3)}
    assert runner.started.get(timeout=5) == 3 and batcher.queued_rows == 0  # running, no longer queued
    answered |= {2: submit(2), 1: submit(1)}
    timed_out = submit(3)
    assert batcher.queued_rows == 6
    assert timed_out.cancel()  # what asyncio.wait_for does to a request that waited too long
    assert batcher.queued_rows == 6  # still queued until a worker drops it
    runner.go.release()
    assert runner.started.get(timeout=5) == 3  # 2 + 1 rows: the timed-out 3 would not have fit beside them
    assert batcher.queued_rows == 3
    runner.go.release()
    batcher.close()
    assert batcher.queued_rows == 0 and runner.started.empty()  # the timed-out request was dropped, not run
    for n, future in answered.items():
        np.testing.assert_array_equal(future.result(timeout=5)["y"], np.full((n, 2), 2 * n, np.float32))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two halves need two cores")
def test_split_cores_loads_two_runners_on_half_the_cores_each_for_one_cpu_instance_only():
    model = served(split_cores=True)
    cores = len(os.sched_getaffinity(0))
    threads = [r.session.get_session_options().intra_op_num_threads for r in model.halves]
    assert threads == [cores // 2, cores - cores // 2]
    assert all(r.session.get_session_options().get_session_config_entry("session.force_spinning_stop") == "1"
               for r in model.halves)
    with pytest.raises(BadInputError, match="--split-cores cannot apply: it comes with --threads; drop one"):
        served(split_cores=True, threads=1)
    with pytest.raises(BadInputError, match="--split-cores cannot apply: it splits one instance, not 2"):
        served(split_cores=True, instances=2)
    assert served().halves == []  # off unless asked


def test_lanes_run_a_lone_batch_on_every_core_and_two_waiting_batches_on_half_the_cores_each():
    wide, first, second = GatedRunner(), GatedRunner(), GatedRunner()
    model = ServedModel("lanes", Path("lanes"), [wide], ["cpu"], max_batch=2, buckets=[], allow_nan=False,
                        halves=[first, second])
    batcher = Batcher(model, max_delay_s=0, max_queue=8, metrics=Metrics())

    def submit(n: int, value: float):
        return batcher.submit({"x": np.full((n, 2), value, np.float32)}, n)

    lone = submit(1, 1)
    assert wide.started.get(timeout=5) == 1  # alone: every core
    queued = [submit(2, 2), submit(2, 3), submit(2, 4)]
    with pytest.raises(queue.Empty):  # the second lane waits while the first runs on every core
        second.started.get(timeout=0.3)
    wide.go.release()
    assert first.started.get(timeout=5) == 2  # a full batch waits behind it: the first lane's half ...
    assert second.started.get(timeout=5) == 2  # ... and beside it, the second lane's
    for runner in (wide, first, second):
        for _ in range(4):
            runner.go.release()
    batcher.close()
    np.testing.assert_array_equal(lone.result(timeout=5)["y"], np.full((1, 2), 2, np.float32))
    for future, value in zip(queued, (2, 3, 4)):
        np.testing.assert_array_equal(future.result(timeout=5)["y"], np.full((2, 2), 2 * value, np.float32))


def test_lanes_leave_the_other_half_of_the_cores_to_requests_on_their_way():
    """Two requests being read make a batch's worth: the first lane runs on its half, not on every core."""
    wide, first, second = GatedRunner(), GatedRunner(), GatedRunner()
    model = ServedModel("lanes", Path("lanes"), [wide], ["cpu"], max_batch=2, buckets=[], allow_nan=False,
                        halves=[first, second])
    batcher = Batcher(model, max_delay_s=0, max_queue=8, metrics=Metrics())
    with batcher.arriving("a"), batcher.arriving("b"):
        pending = batcher.submit({"x": np.ones((2, 2), np.float32)}, 2)
        assert first.started.get(timeout=5) == 2
    assert wide.started.empty()
    first.go.release()
    batcher.close()
    np.testing.assert_array_equal(pending.result(timeout=5)["y"], np.full((2, 2), 2, np.float32))


class RecordingRunner:
    """Doubles its input and records each run's rows and thread; ``fail_rows``: raise on such a run."""

    inputs = GatedRunner.inputs
    outputs = [{"name": "y", "dtype": "float32", "shape": ["batch", 2]}]
    device = "cpu"

    def __init__(self, fail_rows: int | None = None):
        self.runs, self.fail_rows = [], fail_rows

    def run(self, feeds):
        self.runs.append((len(feeds["x"]), threading.current_thread().name))
        if len(feeds["x"]) == self.fail_rows:
            raise RuntimeError("no kernel for this shape")
        return {"y": feeds["x"] * 2}


def test_each_worker_warms_its_runner_up_on_its_thread_before_requests():
    runners = [RecordingRunner(), RecordingRunner()]
    model = ServedModel("rec", Path("rec"), runners, ["cpu", "cpu"], max_batch=4, buckets=[2, 4], allow_nan=False,
                        warmup_sizes=[2, 4], warmup_runs=3)
    metrics = Metrics()
    batcher = Batcher(model, max_delay_s=0, max_queue=8, metrics=metrics)
    batcher.wait_warm()
    for index, runner in enumerate(runners):
        assert runner.runs == [(2, f"rec-{index}")] * 3 + [(4, f"rec-{index}")] * 3
    answer = batcher.submit({"x": np.ones((1, 2), np.float32)}, 1).result(timeout=5)
    batcher.close()
    np.testing.assert_array_equal(answer["y"], np.full((1, 2), 2, np.float32))
    samples = {s.name: s.value for s in metrics.batch_size.labels("rec").collect()[0].samples}
    assert samples["deploykit_batch_size_count"] == 1  # warm-up runs are not counted as served


def test_a_failed_warm_up_is_logged_and_the_worker_still_serves(caplog):
    runner = RecordingRunner(fail_rows=4)
    model = ServedModel("rec", Path("rec"), [runner], ["cpu"], max_batch=4, buckets=[], allow_nan=False,
                        warmup_sizes=[4], warmup_runs=3)
    batcher = Batcher(model, max_delay_s=0, max_queue=8, metrics=Metrics())
    batcher.wait_warm()
    assert runner.runs == [(4, "rec-0")]  # the first failure ends the warm-up
    assert "rec (rec-0): the warm-up run failed" in caplog.text and "no kernel for this shape" in caplog.text
    answer = batcher.submit({"x": np.ones((3, 2), np.float32)}, 3).result(timeout=5)
    batcher.close()
    assert answer["y"].shape == (3, 2)


def test_a_batch_waits_for_the_clients_it_just_answered_and_not_for_a_lone_clients_own_answer():
    """Closed-loop clients on keep-alive connections: after answering A, a worker holding B's request
    waits for A's next one (they run together) instead of running B alone; a lone client's next
    request is not kept waiting by its own earlier answer, and a client that never comes back costs
    at most the delay."""
    runner = RecordingRunner()
    model = ServedModel("rec", Path("rec"), [runner], ["cpu"], max_batch=4, buckets=[], allow_nan=False)
    batcher = Batcher(model, max_delay_s=30, max_queue=8, metrics=Metrics())

    def submit(connection, value: float):
        with batcher.arriving(connection):
            return batcher.submit({"x": np.full((1, 2), value, np.float32)}, 1, connection)

    submit("A", 1).result(timeout=5)  # nothing else on its way: runs at once
    submit("A", 2).result(timeout=5)  # A's own next request: its answer does not hold it back
    waiting = submit("B", 3)
    with pytest.raises(concurrent.futures.TimeoutError):  # A was answered and may come back: B waits
        waiting.result(timeout=0.3)
    joined = submit("A", 4)
    np.testing.assert_array_equal(waiting.result(timeout=5)["y"], np.full((1, 2), 6, np.float32))
    np.testing.assert_array_equal(joined.result(timeout=5)["y"], np.full((1, 2), 8, np.float32))
    assert [rows for rows, _ in runner.runs] == [1, 1, 2]
    batcher.close()

    brief = Batcher(model, max_delay_s=0.2, max_queue=8, metrics=Metrics())
    brief.submit({"x": np.ones((1, 2), np.float32)}, 1, "A").result(timeout=5)
    started = time.perf_counter()
    brief.submit({"x": np.ones((1, 2), np.float32)}, 1, "B").result(timeout=5)  # A never comes back
    assert 0.1 < time.perf_counter() - started < 3
    brief.close()


def test_loaded_models_warm_up_at_their_buckets():
    assert (served().warmup_sizes, served().warmup_runs) == ([4], 3)  # a CPU: no buckets, the largest batch
    assert served(buckets="validated").warmup_sizes == [1, 2, 4]
    assert served(warmup_runs=0).warmup_runs == 0
