"""One tuning run: every candidate opened in turn, checked and timed at each batch size, the
fastest passing one per batch size chosen. The table it returns is what ``record`` writes.

All candidates run in one process with the same timer (``timing``); on a GPU on one stream, with
their inputs already on the device. Each is opened when its turn comes and closed after, so one
backend's threads and memory do not slow the next.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc

import numpy as np

from deploykit.backends.base.feeds import random_inputs
from deploykit.bundle.read import Bundle
from deploykit.bundle.trust import UntrustedNativeCode
from deploykit.backends.tensorrt.shim import local_gpus
from deploykit.errors import EnvironmentProblem, error_summary
from deploykit.tuning import record
from deploykit.tuning.candidates import Candidate, find_candidates, open_runner
from deploykit.tuning.checking import Reference, check, graph_reference, source_reference
from deploykit.tuning.timing import Budget, bench_stream, measure, stream_pointer
from deploykit.versions import tool_versions


@dataclasses.dataclass
class TuneSettings(Budget):
    """``Budget`` (device, warmup, iterations, max_seconds), and what tune adds."""

    warmup: int = 5
    iterations: int = 50
    max_seconds: float = 10.0
    device_id: int = 0
    seed: int = 0
    trust_native: bool = False


def tune_bundle(bundle: Bundle, loaded, settings: TuneSettings, batches: list[int], why_no_source: str = "") -> dict:
    """``deploykit tune``: against the source model when it loaded (``loaded``), else against the
    bundle's validated graph on ONNX Runtime's CPU provider; random inputs at each of ``batches``."""
    reference = source_reference(loaded, bundle) if loaded is not None else graph_reference(bundle)
    feed_sets = [random_inputs(bundle.inputs, batch, settings.seed + index) for index, batch in enumerate(batches)]
    table = tune(bundle, reference, feed_sets, settings)
    if loaded is None and why_no_source:
        table["notes"].append(f"checked against the bundle's graph, not the source model: {why_no_source}")
    return table


def tune(bundle: Bundle, reference: Reference, feed_sets: list[dict], settings: TuneSettings, tick=lambda text: None) -> dict:
    """The tuning table of ``bundle`` on this machine (docs/tuning.md has its fields)."""
    here = record.machine(settings.device, settings.device_id)
    if settings.device == "cuda" and here["gpu"] is None:
        raise EnvironmentProblem(f"cannot tune on cuda:{settings.device_id}: {_no_gpu()}; use --device cpu")
    found = find_candidates(bundle, settings.device, settings.trust_native, settings.device_id)
    rows = []
    with bench_stream(settings.device, tf32=False):  # validated fp32 is what is timed
        for candidate in found:
            tick(candidate.label)
            rows.append(time_candidate(candidate, bundle, reference, feed_sets, settings))
    sizes = [_batch(feeds) for feeds in feed_sets]
    table = {
        **here,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": tool_versions(),
        "reference": reference.label,
        "notes": [],
        "choices": [],
        "unchosen": [],
    }
    for index, batch in enumerate(sizes):
        results = [row[index] for row in rows]
        passed = [r for r in results if r["passed"] and r["p50_ms"] is not None]
        if not passed:
            table["unchosen"].append({"batch": batch, "candidates": results})
            continue
        best = min(passed, key=lambda r: r["p50_ms"])
        best["chosen"] = True
        table["choices"].append({"batch": batch, "backend": best["backend"], "options": best["options"],
                                 "p50_ms": best["p50_ms"], "candidates": results})
    return table


def time_candidate(candidate: Candidate, bundle: Bundle, reference: Reference, feed_sets: list[dict],
                   settings: TuneSettings) -> list[dict]:
    """One result per feed set: checked, then timed; what breaks is recorded with its reason."""
    results = [_result(candidate, reason=candidate.problem) for _ in feed_sets]
    if candidate.problem:
        return results
    runner = None
    try:
        stream = {"stream": stream_pointer(settings.device)} \
            if candidate.backend == "onnxruntime" and settings.device == "cuda" else {}
        runner = open_runner(bundle, candidate.backend, candidate.options, settings.device, settings.device_id,
                             trust_native=settings.trust_native, allow_unvalidated=True, **stream)
        for result, feeds in zip(results, feed_sets):
            _check_and_time(result, candidate, runner, reference, feeds, settings)
    except UntrustedNativeCode:  # consent is the user's to give (--trust-bundle), not a backend failing
        raise
    except Exception as error:  # noqa: BLE001 - one backend failing must not end the run
        for result in results:
            if result["p50_ms"] is None and not result["reason"]:
                result["reason"] = error_summary(error)[:300]
    finally:
        if runner is not None:
            runner.close()
        runner = None
        gc.collect()
    return results


def _check_and_time(result: dict, candidate: Candidate, runner, reference: Reference, feeds: dict,
                    settings: TuneSettings) -> None:
    batch = _batch(feeds)
    if not candidate.accepts(batch):
        result["reason"] = "it takes batch sizes " + ", ".join(
            str(low) if low == high else f"{low}..{high}" for low, high in candidate.batch)
        return
    checked = check(reference, runner, candidate.label, feeds)
    result.update(passed=checked["passed"], max_abs=checked["max_abs"], reason="; ".join(checked["failures"]))
    step = _step(runner, feeds, candidate.backend, settings)
    step()  # first call: graph capture, lazy initialisation
    result["p50_ms"] = float(np.percentile(measure(step, settings), 50) * 1e3)


def _result(candidate: Candidate, reason: str | None = None) -> dict:
    return {"label": candidate.label, "backend": candidate.backend, "options": candidate.options,
            "p50_ms": None, "passed": False, "max_abs": None, "reason": reason or "", "chosen": False}


def _step(runner, feeds: dict, backend: str, settings: TuneSettings):
    """One synchronous inference on inputs where the backend runs: ONNX Runtime runs on the timing
    stream (its outputs are ready when run returns); the others are followed by a device sync."""
    if settings.device != "cuda":
        return lambda: runner.run(feeds)
    import torch

    from deploykit.backends.base.memory import TorchMemory

    memory = TorchMemory(settings.device_id)
    given = {name: memory.to_device(array) for name, array in feeds.items()}
    if backend == "onnxruntime":
        return lambda: runner.run(given)
    return lambda: (runner.run(given), torch.cuda.synchronize(settings.device_id))


def _no_gpu() -> str:
    gpus = local_gpus()
    return gpus if isinstance(gpus, str) else f"this machine has {len(gpus)} GPU(s)"


def _batch(feeds: dict) -> int:
    return int(next(iter(feeds.values())).shape[0])

