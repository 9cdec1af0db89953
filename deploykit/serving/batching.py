"""Dynamic batching: requests for one model wait in one queue; one worker thread per runner
takes what fits in ``max_batch`` rows, waiting for more to join, pads the rows up to a bucket size,
runs once and splits the outputs back by request. It waits only while that can help, and never
longer than ``max_delay`` without progress:

- while another request is on its way (being read and parsed), or while the rows would be padded (a
  run costs its bucket's time, so rows that fill a bucket exactly, a lone request at batch 1 say, run
  at once, as Triton's preferred batch sizes do): up to ``max_delay`` after the oldest request arrived
  or the worker came free, whichever is later;
- while clients it has answered have not sent their next request on the same connection: up to
  ``max_delay`` after the latest of them came back (or was answered). Closed-loop clients (a fixed
  number of callers, each sending as soon as it has its answer) come back within a millisecond or
  two; without waiting for them, N such clients settle into two alternating half batches, each
  computing on cores that the other half's parsing contends for, and a straggler that just missed a
  batch waits a whole run. A lone client is never held back by its own answer.
Before its first request a worker warms its runner up (``ServedModel.warmup_sizes``) on its own
thread, where its first requests will run; ``wait_warm`` returns once all have.

Threads, not the event loop: runners release the GIL while they compute (ONNX Runtime,
TensorRT), so N instances run N batches at once while the loop keeps parsing requests.

Lanes (a CPU model with ``halves``): two workers, each with a runner on half the cores. The first
runs a batch on the instance with every core (the lowest latency) unless the second lane is busy or a
full batch's rows wait behind it or are on their way (being read, or due back from clients just
answered: judged on the queue alone, a lane that took the queued rows ran wide while the answered
clients' next requests piled up behind it); then it runs on its half, and only while it does, the
second lane takes the next batch and runs it on the other half. Under load the two batches run side
by side, which takes more batches a second where requests are parsed on the same cores
(BENCHMARKS.md), and no run ever shares its cores. A lone request always finds the first lane, so it
never runs on half the cores.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from concurrent.futures import Future

import numpy as np

from deploykit.backends.base.feeds import random_inputs
from deploykit.backends.base.memory import torch_to_host
from deploykit.errors import BadInputError
from deploykit.serving.gpu_health import lost_context, lost_message
from deploykit.serving.models import ServedModel
from deploykit.serving.protocol import RequestError
from deploykit.serving.staging import PinnedStaging, copy_rows, host_answers

log = logging.getLogger("deploykit.serve")


@dataclasses.dataclass
class Pending:
    inputs: dict[str, np.ndarray]
    rows: int
    future: Future
    arrived: float
    connection: object = None  # the client's connection (ASGI's client address), when known


class Batcher:
    """The queue and workers of one model. ``submit`` returns a Future of its outputs."""

    def __init__(self, model: ServedModel, max_delay_s: float, max_queue: int, metrics, on_lost=None,
                 staging_for=PinnedStaging.for_runner):
        """``on_lost(message)``: once, when a failed run on a GPU finds its CUDA context lost (``gpu_health``);
        ``staging_for(runner, gpu)``: where a worker assembles its runner's batches (``staging``; None: numpy)."""
        self.model, self.max_delay, self.max_queue, self.metrics = model, max_delay_s, max_queue, metrics
        self.on_lost, self.staging_for = on_lost, staging_for
        self._queue: collections.deque[Pending] = collections.deque()
        self._rows = 0  # the rows in _queue, kept as it changes: workers ask on every wake-up
        self._arriving = 0  # requests being read and parsed, which may still join a batch
        self._answered: set = set()  # connections answered whose next request has not begun to arrive
        self._progress = 0.0  # when one of them was answered or came back last
        self._ready = threading.Condition()
        self._closed = False
        self._first_on_half = self._second_busy = False  # lanes' runs in flight (``_lane_runner``)
        lanes = model.halves or model.runners
        self._warm = [threading.Event() for _ in lanes]
        gpus = model.gpus or [None] * len(lanes)
        self._workers = [threading.Thread(target=self._work, args=(runner, gpu, warm), name=f"{model.name}-{i}",
                                          daemon=True)
                         for i, (runner, gpu, warm) in enumerate(zip(lanes, gpus, self._warm))]
        for worker in self._workers:
            worker.start()

    def submit(self, inputs: dict[str, np.ndarray], rows: int, connection=None) -> Future:
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RequestError(503, "the server is shutting down", "shutting_down", {"Retry-After": "1"})
            if len(self._queue) >= self.max_queue:
                raise RequestError(503, f"{self.model.name}'s queue is full ({self.max_queue} requests waiting): "
                                        "retry later", "queue_full", {"Retry-After": "1"})
            self._queue.append(Pending(inputs, rows, future, time.perf_counter(), connection))
            self._rows += rows
            self._queue_changed()
            self._ready.notify(2 if self.model.halves else 1)  # a second lane may not take it: wake the first too
        return future

    @contextlib.contextmanager
    def arriving(self, connection=None):
        """Around reading, parsing and submitting one request (on ``connection``, when known): while
        any is, a worker with room in its batch waits (up to max_delay) for it."""
        with self._ready:
            self._arriving += 1
            if connection in self._answered:
                self._answered.discard(connection)
                self._progress = time.perf_counter()
        try:
            yield
        finally:
            with self._ready:
                self._arriving -= 1
                self._ready.notify_all()

    def body_buffer(self, size: int, header_length: int):
        """Where to read a request's body (None: anywhere): the runners read this process's memory."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Refuse new requests, let the workers finish every queued one, and wait for them."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        for worker in self._workers:
            worker.join()

    @property
    def queued_rows(self) -> int:
        """Rows waiting (requests that timed out included until a worker drops them)."""
        return self._rows

    def _queue_changed(self) -> None:
        self.metrics.child(self.metrics.queue_depth, self.model.name).set(len(self._queue))

    def wait_warm(self) -> None:
        """Return once every worker has warmed its runner up (or failed to, which it logged)."""
        for warm in self._warm:
            warm.wait()

    def _work(self, runner, gpu: int | None, warm: threading.Event) -> None:
        second = bool(self.model.halves) and runner is self.model.halves[1]
        try:
            self._warm_up(runner)
            if self.model.halves and not second:
                self._warm_up(self.model.runner)
        finally:
            warm.set()
        staging = self.staging_for(runner, gpu) if self.model.batching else None
        while (batch := self._take(second)) is not None:
            if batch:
                with self._lane_runner(runner, second) as chosen:
                    self._run(chosen, batch, staging)

    @contextlib.contextmanager
    def _lane_runner(self, runner, second: bool):
        """The runner for a batch just taken: the worker's own, except for the first of two lanes (the
        module's docstring), which takes every core unless the second lane is busy or a full batch's rows
        wait or are on their way (``_rows_to_come``)."""
        if not self.model.halves:
            yield runner
            return
        with self._ready:
            wide = not second and not self._second_busy and self._rows_to_come() < self.model.max_batch
            if not second and not wide:
                self._first_on_half = True
                self._ready.notify_all()  # the second lane may take the next batch now
        try:
            yield self.model.runner if wide else runner
        finally:
            with self._ready:
                if second:
                    self._second_busy = False
                elif not wide:
                    self._first_on_half = False

    def _rows_to_come(self) -> int:
        """Rows queued or on their way (one per request being read or due back from an answered client)."""
        return self._rows + self._arriving + len(self._answered)

    def _warm_up(self, runner) -> None:
        model = self.model
        if not model.warmup_runs or not model.warmup_sizes:
            return
        started = time.perf_counter()
        try:
            for size in model.warmup_sizes:
                feeds = random_inputs(model.inputs, size, seed=0)
                for _ in range(model.warmup_runs):
                    runner.run(feeds)
        except Exception:  # noqa: BLE001 - requests then get the runner's error; the server stays up
            log.exception("%s (%s): the warm-up run failed", model.name, threading.current_thread().name)
            return
        sizes = ", ".join("static" if size is None else str(size) for size in model.warmup_sizes)
        log.info("%s (%s): warmed up at batch %s in %.1f s", model.name, threading.current_thread().name, sizes,
                 time.perf_counter() - started)

    def _take(self, second: bool = False) -> list[Pending] | None:
        """The next batch (requests in arrival order, cancelled ones dropped); None once closed and drained.
        ``second``: the second of two lanes, which takes one only while the first runs on its half."""
        free = time.perf_counter()
        with self._ready:
            while not self._queue or (second and not self._first_on_half):
                if self._closed and (second or not self._queue):
                    return None
                self._ready.wait()
            deadline = max(self._queue[0].arrived, free) + self.max_delay
            while not self._closed and self._rows < self.model.max_batch and (left := self._patience(deadline)) > 0:
                self._ready.wait(left)
                if not self._queue:  # another worker took them
                    return []
            batch, rows = [], 0
            while self._queue and (not batch or rows + self._queue[0].rows <= self.model.max_batch):
                pending = self._queue.popleft()
                self._rows -= pending.rows
                if pending.future.set_running_or_notify_cancel():  # False: it timed out while waiting
                    batch.append(pending)
                    rows += pending.rows
            self._second_busy = second and bool(batch)
            self._queue_changed()
            return batch

    def _patience(self, deadline: float) -> float:
        """Seconds a worker with room in its batch may still wait for more rows (0 or less: run now)."""
        now = time.perf_counter()
        left = deadline - now if self._arriving or self._padded(self._rows) else 0.0
        if self._answered:
            if now - self._progress >= self.max_delay:
                self._answered.clear()  # the rest are not coming back soon: stop waiting for them
            else:
                left = max(left, self._progress + self.max_delay - now)
        return left

    def _padded(self, rows: int) -> bool:
        return _bucket(self.model.buckets, rows) != rows

    def _run(self, runner, batch: list[Pending], staging: PinnedStaging | None) -> None:
        started = time.perf_counter()
        rows = [p.rows for p in batch]
        try:
            results = run_rows(self.model, runner, [p.inputs for p in batch], rows, staging)
        except Exception as error:  # noqa: BLE001 - every waiting request gets an answer
            failure = as_request_error(error, self.model.name)
            self._expect_back(batch)
            for pending in batch:
                pending.future.set_exception(failure)
            self._check_gpu(runner)
            return
        finally:
            self.metrics.observe_run(self.model.name, sum(rows), started, [p.arrived for p in batch])
        self._expect_back(batch)
        for pending, result in zip(batch, results):
            pending.future.set_result(result)

    def _expect_back(self, batch: list[Pending]) -> None:
        """Note the batch's connections as answered: their next requests may join the next batch."""
        connections = {pending.connection for pending in batch} - {None}
        if connections:
            with self._ready:
                self._answered |= connections
                self._progress = time.perf_counter()

    def _check_gpu(self, runner) -> None:
        if self.on_lost is None or runner.device != "cuda":
            return
        device = self.model.placements[self.model.runners.index(runner)]
        if (why := lost_context(device)) is None:
            return
        with self._ready:  # said once, though every instance's next run fails alike
            on_lost, self.on_lost = self.on_lost, None
        if on_lost is not None:
            on_lost(lost_message(self.model.name, device, why))


def run_rows(model: ServedModel, runner, requests: list[dict[str, np.ndarray]], rows: list[int],
             staging: PinnedStaging | None = None) -> list[dict]:
    """Several checked requests (``ServedModel.check`` gave their rows) in one run of ``runner``:
    their rows concatenated in order (in ``staging``'s buffers when given) and padded up to the
    bucket, the outputs split back by request. ``deploykit serve``'s batcher and the Triton python
    model both run batches through here."""
    feeds = _batch_feeds(model, requests, sum(rows), staging)
    try:
        outputs = runner.run(feeds)
        if not model.batching:  # one request, its outputs whole
            return [{name: value if isinstance(value, np.ndarray) else torch_to_host(value)
                     for name, value in outputs.items()}]
        return staging.answers(outputs, requests, rows) if staging is not None else host_answers(outputs, rows)
    except Exception:
        if staging is not None:
            staging.drain()
        raise


def _batch_feeds(model: ServedModel, requests: list[dict[str, np.ndarray]], rows: int,
                 staging: PinnedStaging | None) -> dict[str, np.ndarray]:
    """One feed per input: the requests' rows in order, zero rows padded up to the bucket."""
    if not model.batching:
        return requests[0]
    size = _bucket(model.buckets, rows)
    if staging is not None:
        return staging.feeds([spec["name"] for spec in model.inputs], requests, rows, size)
    feeds = {}
    for spec in model.inputs:
        parts = [inputs[spec["name"]] for inputs in requests]
        if len(parts) == 1 and size == rows:
            feeds[spec["name"]] = parts[0]
            continue
        batch = np.empty((size, *parts[0].shape[1:]), parts[0].dtype)
        copy_rows(parts, batch[:rows])
        batch[rows:] = 0
        feeds[spec["name"]] = batch
    return feeds


def _bucket(buckets: list[int], rows: int) -> int:
    """The smallest bucket that holds ``rows`` (the rows themselves without buckets, or beyond them)."""
    index = bisect.bisect_left(buckets, rows)
    return buckets[index] if index < len(buckets) else rows


def as_request_error(error: Exception, model: str) -> RequestError:
    """A failed run as the answer each of its requests gets: 400 for bad input, else 500 (logged)."""
    if isinstance(error, RequestError):
        return error
    if isinstance(error, BadInputError):
        return RequestError(400, str(error))
    log.exception("model %s failed", model)
    return RequestError(500, f"{model} failed to run: {type(error).__name__}: {error}", "model_failed")
