"""What ``/metrics`` exposes, in Prometheus' text format (prometheus-client writes it).

One registry per server, so that servers in one process (the tests) do not share counts. The
workers of ``serve --workers`` (prometheus-client's multiprocess mode, PROMETHEUS_MULTIPROC_DIR)
write their values to files in one folder, and each renders the sum of them all.
"""

from __future__ import annotations

import os
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: The environment variable that puts prometheus-client in multiprocess mode (read at its import).
MULTIPROCESS_DIR = "PROMETHEUS_MULTIPROC_DIR"
#: Rows per run: powers of two up to the largest batches bundles are converted for.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: Seconds, from a fraction of a millisecond (a small model on a GPU) to the longest timeout.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        labelled = {"registry": self.registry}
        self.requests = Counter("deploykit_requests", "Infer requests answered, by model and HTTP status.",
                                ["model", "status"], **labelled)
        self.errors = Counter("deploykit_request_errors", "Requests refused or failed, by reason.",
                              ["model", "reason"], **labelled)
        self.queue_depth = Gauge("deploykit_queue_depth", "Requests waiting for a batch.", ["model"],
                                 multiprocess_mode="livesum", **labelled)
        self.batch_size = Histogram("deploykit_batch_size", "Rows per model run (padding excluded).", ["model"],
                                    buckets=BATCH_BUCKETS, **labelled)
        self.request_latency = Histogram("deploykit_request_latency_seconds",
                                         "Infer request time, body received to response ready.", ["model"],
                                         buckets=LATENCY_BUCKETS, **labelled)
        self.queue_latency = Histogram("deploykit_queue_latency_seconds", "Time a request waited for its batch.",
                                       ["model"], buckets=LATENCY_BUCKETS, **labelled)
        self.run_latency = Histogram("deploykit_run_latency_seconds", "Time of one model run (one batch).",
                                     ["model"], buckets=LATENCY_BUCKETS, **labelled)

        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)``, kept: prometheus-client validates and locks on every call, which
        the hot path pays per request. The labels are served models, statuses and reasons: few."""
        key = (metric, labels)
        if (found := self._children.get(key)) is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def observe_run(self, model: str, rows: int, started: float, arrivals: list[float]) -> None:
        self.child(self.batch_size, model).observe(rows)
        self.child(self.run_latency, model).observe(time.perf_counter() - started)
        queue_latency = self.child(self.queue_latency, model)
        for arrived in arrivals:
            queue_latency.observe(started - arrived)

    def answered(self, model: str, status: int, reason: str | None = None) -> None:
        self.child(self.requests, model, str(status)).inc()
        if reason is not None:
            self.child(self.errors, model, reason).inc()

    def render(self) -> tuple[bytes, str]:
        if shared := os.environ.get(MULTIPROCESS_DIR):
            from prometheus_client import multiprocess

            every_worker = CollectorRegistry()
            multiprocess.MultiProcessCollector(every_worker, path=shared)
            return generate_latest(every_worker), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
