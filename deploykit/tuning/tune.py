"""One tuning run: at each batch size every candidate opened, checked and timed, the fastest
passing one chosen. The table it returns is what ``record`` writes.

All candidates run in one process with the same timer (``timing``); on a GPU on one stream, with
their inputs already on the device. At each batch size all are open together and timed side by
side in interleaved rounds (``timing.interleave``), so drift during the run does not favour the
one timed first; they are closed before the next size, so their memory does not pile up.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc

from deploykit.backends.base.feeds import random_inputs
from deploykit.bundle.read import Bundle
from deploykit.bundle.trust import UntrustedNativeCode
from deploykit.backends.tensorrt.shim import local_gpus
from deploykit.errors import EnvironmentProblem, with_reason
from deploykit.tuning import record
from deploykit.tuning.candidates import Candidate, find_candidates, open_runner
from deploykit.tuning.checking import Reference, check, graph_reference, source_reference
from deploykit.tuning.timing import Budget, Step, bench_stream, interleave, round_stats, stream_pointer
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
    tolerances: tuple[str, ...] = ()  # --tolerance: applied after the bundle's recorded ones


def tune_bundle(bundle: Bundle, loaded, settings: TuneSettings, batches: list[int], why_no_source: str = "") -> dict:
    """``deploykit tune``: against the source model when it loaded (``loaded``), else against the
    bundle's validated graph on ONNX Runtime's CPU provider; random inputs at each of ``batches``."""
    reference = (source_reference(loaded, bundle, settings.tolerances) if loaded is not None
                 else graph_reference(bundle, settings.tolerances))
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
    with bench_stream(settings.device, tf32=False):  # validated fp32 is what is timed
        columns = [time_batch(found, bundle, reference, feeds, settings, tick) for feeds in feed_sets]
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
    for batch, results in zip(sizes, columns):
        passed = [r for r in results if r["passed"] and r["p50_ms"] is not None]
        if not passed:
            table["unchosen"].append({"batch": batch, "candidates": results})
            continue
        best = min(passed, key=lambda r: r["p50_ms"])
        best["chosen"] = True
        table["choices"].append({"batch": batch, "backend": best["backend"], "options": best["options"],
                                 "p50_ms": best["p50_ms"], "candidates": results})
    return table


def time_batch(found: list[Candidate], bundle: Bundle, reference: Reference, feeds: dict, settings: TuneSettings,
               tick=lambda text: None) -> list[dict]:
    """One result per candidate at one batch size: every candidate opened and checked (all open
    together), then timed side by side in interleaved rounds, then closed before the next size.
    What breaks is recorded with its reason."""
    results, runners, ready = [_result(c, reason=c.problem) for c in found], [], []
    try:
        for candidate, result in zip(found, results):
            tick(f"{candidate.label}, batch {_batch(feeds)}")
            if (step := _checked_step(candidate, result, bundle, reference, feeds, settings, runners)) is not None:
                ready.append((result, step))
        for (result, _), timed in zip(ready, interleave([step for _, step in ready], settings, tick)):
            if timed.error is not None:
                _add_reason(result, timed.error)
            else:
                stats = round_stats(timed.rounds)
                result.update(p50_ms=stats["p50_ms"], spread=stats["spread"])
    finally:
        for runner in runners:
            runner.close()
        runners = ready = None
        gc.collect()
    return results


def _checked_step(candidate: Candidate, result: dict, bundle: Bundle, reference: Reference, feeds: dict,
                  settings: TuneSettings, runners: list) -> Step | None:
    """The candidate opened (into ``runners``), its outputs checked, its step called once; None
    where it cannot run this batch size or broke (the reason is in ``result``)."""
    batch = _batch(feeds)
    if candidate.problem:
        return None
    if not candidate.accepts(batch):
        result["reason"] = "it takes batch sizes " + ", ".join(
            str(low) if low == high else f"{low}..{high}" for low, high in candidate.batch)
        return None
    try:
        stream = {"stream": stream_pointer(settings.device)} \
            if candidate.backend == "onnxruntime" and settings.device == "cuda" else {}
        runners.append(open_runner(bundle, candidate.backend, candidate.options, settings.device, settings.device_id,
                                   trust_native=settings.trust_native, allow_unvalidated=True, **stream))
        checked = check(reference, runners[-1], candidate.label, feeds)
        result.update(passed=checked["passed"], max_abs=checked["max_abs"], reason="; ".join(checked["failures"]))
        step = _step(runners[-1], feeds, candidate.backend, settings)
        step()  # first call: graph capture, lazy initialisation
        return step
    except UntrustedNativeCode:  # consent is the user's to give (--trust-bundle), not a backend failing
        raise
    except Exception as error:  # noqa: BLE001 - one backend failing must not end the run
        _add_reason(result, error)
        return None


def _add_reason(result: dict, error: Exception) -> None:
    """A candidate that broke is not timed (its p50 stays None); why is added to what its check said."""
    result.update(p50_ms=None, reason=with_reason(result["reason"], error))


def _result(candidate: Candidate, reason: str | None = None) -> dict:
    return {"label": candidate.label, "backend": candidate.backend, "options": candidate.options,
            "p50_ms": None, "spread": None, "passed": False, "max_abs": None, "reason": reason or "", "chosen": False}


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

