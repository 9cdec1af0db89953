"""``deploykit bench``: latency and throughput of a bundle's backends side by side, per batch size.

Each contender (PyTorch eager, torch.compile and torch.compile(mode="reduce-overhead"), in fp32
and in the bundle's reduced precision, ONNX Runtime on the plain export, on deploykit's graph with
its ONNX functions and with our op library, with CUDA graphs, TensorRT, the bundle's AOTInductor
packages, and ``deploykit.load(bundle)`` as users get it) turns a feed set into a zero-argument step that runs one
inference to completion. Per batch size every contender is set up (all alive together, freed
before the next size) and warmed up, then all are timed in interleaved rounds, each round timing
every contender in turn (:func:`deploykit.tuning.timing.interleave`), so drift over the run
(clocks, heat) does not favour whichever ran first; p50 is the median of the rounds' medians.
What cannot run here is listed with the reason instead of silently missing from the table.
Inputs live where the backend runs (CUDA tensors on a GPU), so the numbers measure inference,
not host copies.

On a GPU every contender runs on one bench stream (ONNX Runtime through its
``user_compute_stream``) and each call is timed by CUDA events recorded on that stream before
and after it: the latency of one synchronous inference, launch gaps included (the timer lives in
:mod:`deploykit.tuning.timing`, shared with ``deploykit tune``). ``vs_reduce_overhead`` puts each
result against torch.compile(mode="reduce-overhead") in the same precision at the same batch size.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import gc
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from deploykit import runtime
from deploykit.bundle.trust import UntrustedNativeCode
from deploykit.errors import BadInputError, DeployKitError, error_summary, with_reason
from deploykit.tuning.candidates import find_candidates, open_runner
from deploykit.tuning.timing import (
    TIMING, Step, bench_stream, calls_per_round, interleave, stream_pointer, summarize,
)
from deploykit.versions import tool_versions


@dataclasses.dataclass
class Settings:
    """How to measure (:class:`deploykit.tuning.timing.Budget`'s fields): ``max_seconds`` bounds one
    (contender, batch) measurement, shared out over its ``rounds``."""

    batch_sizes: list[int]
    device: str = "cpu"
    warmup: int = 10
    iterations: int = 100
    max_seconds: float = 20.0
    rounds: int = 5
    seed: int = 0
    tf32: bool = False  # let fp32 matrix products round to TF32 (ONNX Runtime's and PyTorch's alike)
    trust_native: bool = False  # load the bundle's native code even where this machine did not build it


@dataclasses.dataclass
class Contender:
    """One thing to time. ``setup(notes)`` builds the backend (a session, a compiled module) for one
    batch size, adds what its runner notes to ``notes`` (bench.json and the console carry them, as
    ``run`` prints them) and returns ``prepare(feeds) -> step``; without ``setup``, ``reason`` says
    why it is skipped (or, with ``failed``, why it broke)."""

    key: str
    label: str
    setup: Callable[[list[str]], Callable[[dict], Step]] | None = None
    reason: str = ""
    failed: bool = False
    inputs: list[dict] | None = None  # input specs when it runs another bundle than the benched one
    precision: str = "fp32"  # what it computes in: its vs_reduce_overhead is against that precision's


@dataclasses.dataclass
class SourceModel:
    """The PyTorch model behind the bundle, or why it could not be loaded."""

    loaded: object | None
    reason: str = ""


def load_source(bundle: runtime.Bundle, model: Path | None, factory: str | None, trust_pickle: bool) -> SourceModel:
    """--model (default: the manifest's ``source`` when that file exists), through deploykit.conversion.loading.

    A relative ``source`` was relative to where convert ran: tried from here, then beside the bundle.
    """
    path = Path(model) if model else Path(bundle.manifest.get("source", ""))
    if not model and not path.is_file() and (bundle.path.parent / path).is_file():
        path = bundle.path.parent / path
    if not model and not path.is_file():
        return SourceModel(None, f"the source model {str(path)!r} recorded in the manifest is not here; pass --model")
    try:
        from deploykit.conversion.loading import load_model

        return SourceModel(load_model(path, factory, trust_pickle))
    except DeployKitError as error:
        return SourceModel(None, f"cannot load {path}: {error}")


# --------------------------------------------------------------------------- contenders


REDUCED = ("fp16", "bf16")
#: the PyTorch precision a bundle is measured against: fp8 computes all but its Linear products in fp16
PYTORCH_PRECISION = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "int8": "fp32", "fp8": "fp16"}
PYTORCH_KEYS = ("pytorch", "torch-compile", "reduce-overhead")
KEYS = (*PYTORCH_KEYS, *(f"{key}-{p}" for p in REDUCED for key in PYTORCH_KEYS),
        "ort-plain", "ort-functions", "ort-deploykit", "ort-cuda-graph", "baseline", "baseline-cuda-graph", "tensorrt",
        "aoti-static", "aoti-dynamic", "openvino", "deploykit-load")
#: torch.compile(mode="reduce-overhead"): CUDA graphs on a GPU; on the CPU it compiles but has none to replay.
REDUCE_OVERHEAD = "reduce-overhead"


def contenders(bundle: runtime.Bundle, settings: Settings, source: SourceModel, *, plain_onnx: Path | None = None,
               export_plain: bool = False, baseline: runtime.Bundle | None = None,
               only: set[str] | None = None) -> list[Contender]:
    """Everything bench compares, in a fixed order; skipped ones carry their reason.

    Backends are built per batch size, all of them, timed side by side and dropped before the
    next size (``bench_batch``). Only the plain export is made here, while the source model is
    still untouched by any contender.
    ``baseline`` is another bundle of the same model (say the fp32 one beside an fp16 one),
    timed in ONNX Runtime in the same run.
    """
    graph = "ONNX Runtime: deploykit graph" + (" + op library" if bundle.op_library else "")
    device, tf32, trust_native = settings.device, settings.tf32, settings.trust_native
    precision = PYTORCH_PRECISION[bundle.manifest.get("precision", "fp32")]
    ro_label = 'torch.compile(mode="reduce-overhead")' + ("" if device == "cuda" else " (CPU: no CUDA graphs)")
    plans = [
        ("pytorch", "PyTorch eager", lambda: _eager(source, device)),
        ("torch-compile", "torch.compile", lambda: _compiled(source, device)),
        (REDUCE_OVERHEAD, ro_label, lambda: _compiled(source, device, mode=REDUCE_OVERHEAD)),
    ]
    if precision in REDUCED:  # the fair PyTorch baseline for a reduced-precision bundle
        plans += [
            (f"pytorch-{precision}", f"PyTorch eager, {precision}", lambda: _eager(source, device, precision)),
            (f"torch-compile-{precision}", f"torch.compile, {precision}", lambda: _compiled(source, device, precision)),
            (f"{REDUCE_OVERHEAD}-{precision}", f"{ro_label}, {precision}",
             lambda: _compiled(source, device, precision, REDUCE_OVERHEAD)),
        ]
    plans += [
        ("ort-plain", "ONNX Runtime: plain export", lambda: _plain(bundle, device, tf32, source, plain_onnx, export_plain)),
        ("ort-functions", "ONNX Runtime: deploykit graph, ONNX functions", lambda: _ort(bundle, device, tf32, False)),
        ("ort-deploykit", graph, lambda: _ort(bundle, device, tf32, True, trust_native)),
        ("ort-cuda-graph", "ONNX Runtime's floor: a hand-written IOBinding + CUDA graph",
         lambda: _ort_cuda_graph(bundle, device, tf32, trust_native)),
    ]
    if baseline is not None:
        name = f"{baseline.path.name} ({baseline.manifest.get('precision', 'fp32')})"
        plans += [
            ("baseline", f"ONNX Runtime: baseline bundle {name}",
             lambda: _ort(baseline, device, tf32, True, trust_native)),
            ("baseline-cuda-graph", f"ONNX Runtime: baseline bundle {name}, CUDA graph",
             lambda: _ort_cuda_graph(baseline, device, tf32, trust_native)),
        ]
    plans.append(("tensorrt", "TensorRT engine", lambda: _tensorrt(bundle, device, trust_native)))
    plans += [(f"aoti-{kind}", f"AOTInductor, {kind} package{'s' if kind == 'static' else ''}",
               functools.partial(_aoti, bundle, device, trust_native, kind)) for kind in ("static", "dynamic")]
    plans.append(("openvino", "OpenVINO model", lambda: _openvino(bundle, device)))
    plans.append(("deploykit-load", "deploykit.load(bundle)", lambda: _default_load(bundle, device, trust_native)))
    if not bundle.op_library:  # without our ops the two deploykit-graph contenders are the same
        plans = [plan for plan in plans if plan[0] != "ort-functions"]
    found = [_contender(key, label, plan, only) for key, label, plan in plans]
    for contender in found:
        contender.precision = _precision_of(contender.key, bundle, baseline)
        if contender.key.startswith("baseline"):
            contender.inputs = baseline.inputs
    return found


def _precision_of(key: str, bundle: runtime.Bundle, baseline: runtime.Bundle | None) -> str:
    """What a contender computes in: PyTorch's says it in its key, a bundle's is the bundle's precision."""
    if key.startswith(PYTORCH_KEYS):
        return next((p for p in REDUCED if key.endswith(f"-{p}")), "fp32")
    if key == "ort-plain":
        return "fp32"
    return (baseline if key.startswith("baseline") else bundle).precision


def _contender(key: str, label: str, plan, only: set[str] | None) -> Contender:
    """``plan()`` returns the setup function, or a string saying why this contender cannot run."""
    if only is not None and key not in only:
        return Contender(key, label, reason="not selected (--only)")
    try:
        setup = plan()
    except Exception as error:  # noqa: BLE001 - reported in the table
        return Contender(key, label, reason=error_summary(error)[:300], failed=True)
    return Contender(key, label, reason=setup) if isinstance(setup, str) else Contender(key, label, setup)


def _torch_feeds(feeds: dict, device: str) -> list:
    import torch

    return [torch.from_numpy(array).to(device) for array in feeds.values()]


def _synchronize(device: str) -> Callable[[], None]:
    if device == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None


def cast_feeds(feeds: dict, precision: str = "fp32") -> dict:
    """Floating inputs in the precision PyTorch runs in (a bundle may take fp16 inputs, the source model fp32)."""
    import torch

    dtype = torch_dtype(precision)
    return {name: torch.from_numpy(a.astype(np.float32)).to(dtype) if a.dtype.kind == "f" else torch.from_numpy(a)
            for name, a in feeds.items()}


def torch_dtype(precision: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]


def _module_step(module, device: str, precision: str, graphs: bool = False) -> Callable[[dict], Step]:
    """``graphs``: the module replays CUDA graphs (reduce-overhead), so each call starts a new step
    (its outputs may be overwritten by the next replay, which a benchmark does not read)."""
    def prepare(feeds: dict) -> Step:
        import torch

        args, sync = [t.to(device) for t in cast_feeds(feeds, precision).values()], _synchronize(device)

        def step():
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.inference_mode():
                result = module(*args)
            sync()
            return result

        return step

    return prepare


def _module_copy(source: SourceModel, device: str, precision: str):
    """A copy of the source model on ``device`` in ``precision``: the source itself stays as loaded."""
    return copy.deepcopy(source.loaded.module).to(device=device, dtype=torch_dtype(precision))


def _pytorch_problem(source: SourceModel, device: str, precision: str) -> str | None:
    if source.loaded is None:
        return source.reason
    if precision != "fp32" and device != "cuda":
        return f"PyTorch {precision} is measured on the GPU only (the CPU is not where it would be deployed)"
    return None


def _eager(source: SourceModel, device: str, precision: str = "fp32"):
    if problem := _pytorch_problem(source, device, precision):
        return problem
    return lambda notes: _module_step(_module_copy(source, device, precision), device, precision)


def _compiled(source: SourceModel, device: str, precision: str = "fp32", mode: str | None = None):
    if problem := _pytorch_problem(source, device, precision):
        return problem
    if source.loaded.kind == "torchscript":
        return "torch.compile does not take TorchScript modules"

    def setup(notes):
        import torch

        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "no CUDA runtime" on CPU machines
        compiled = torch.compile(_module_copy(source, device, precision), mode=mode)
        return _module_step(compiled, device, precision, graphs=mode == REDUCE_OVERHEAD and device == "cuda")

    return setup


def _plain(bundle, device, tf32: bool, source: SourceModel, plain_onnx: Path | None, export_plain: bool):
    """The plain export is made now, at planning time, from the source model as loaded."""
    if plain_onnx is None and not export_plain:
        return "the bundle keeps only deploykit's graph; pass --plain-onnx FILE, or --export-plain to re-export the source model"
    if plain_onnx is None and source.loaded is None:
        return f"--export-plain needs the source model: {source.reason}"
    model = Path(plain_onnx) if plain_onnx else export_plain_onnx(bundle, source.loaded)
    return _ort(bundle, device, tf32, False, model=model)


def export_plain_onnx(bundle: runtime.Bundle, loaded) -> Path:
    """Re-export the source model as the bundle was exported (no deploykit passes), to a temp file
    that lives as long as this process."""
    import onnx

    from deploykit.conversion.export import export_onnx
    from deploykit.specs import BatchRange

    dynamic = runtime.batch_sizes(bundle.inputs)
    example = runtime.random_inputs(bundle.inputs, max(2, dynamic[1]) if dynamic else None, seed=1234)
    exported = export_onnx(loaded, cast_feeds(example), [o["name"] for o in bundle.outputs],
                           BatchRange(*dynamic) if dynamic else None,
                           bundle.manifest["opset"], bundle.manifest.get("exporter", "auto"))
    folder = tempfile.TemporaryDirectory(prefix="deploykit-bench-")
    _TEMPORARY.append(folder)
    path = Path(folder.name) / "plain.onnx"
    onnx.save_model(exported.model, path)
    return path


_TEMPORARY: list[tempfile.TemporaryDirectory] = []  # removed when the process ends


def _ort(bundle, device, tf32: bool, op_library: bool, trust_native: bool = False, model: Path | None = None):
    if device == "cuda" and not runtime.ort_has_cuda():
        return f"onnxruntime has no {runtime.CUDA_EP} (pip install onnxruntime-gpu)"

    def setup(notes):
        # timing, not outputs: any batch the user asks for is measured, validated or not
        runner = runtime.load_onnxruntime(bundle, device, op_library=op_library, model=model,
                                          stream=stream_pointer(device), tf32=tf32, allow_unvalidated=True,
                                          trust_native=trust_native)
        notes += runner.notes

        def prepare(feeds: dict) -> Step:
            given = dict(zip(feeds, _torch_feeds(feeds, device))) if device == "cuda" else feeds
            return lambda: runner.run(given)

        return prepare

    return setup


def _ort_cuda_graph(bundle, device, tf32: bool, trust_native: bool):
    if device != "cuda" or not runtime.ort_has_cuda():
        return f"CUDA graphs need a GPU and onnxruntime-gpu's {runtime.CUDA_EP}"
    return lambda notes: functools.partial(cuda_graph_step, bundle, tf32, trust_native, notes=notes)


def cuda_graph_step(bundle: runtime.Bundle, tf32: bool, trust_native: bool, feeds: dict, *,
                    copy_from: list | None = None, notes: list[str] | None = None) -> Step:
    """ONNX Runtime's floor, which the runner is measured against: a session per batch size with a
    CUDA graph, bound once to inputs already in place and to preallocated outputs (nothing a
    runner does per call costs less). With ``copy_from`` (CUDA tensors, one per input), each call
    first copies them into the bound inputs, as a hand-written loop over new inputs must. The
    session's notes go into ``notes``."""
    runner = runtime.load_onnxruntime(bundle, "cuda", cuda_graph=True, stream=stream_pointer("cuda"), tf32=tf32,
                                      trust_native=trust_native)
    if notes is not None:
        notes += runner.notes
    memory = runtime.TorchMemory(0)
    given = {name: runtime.as_feed(name, memory.to_device(array)) for name, array in feeds.items()}
    binding = runner.session.io_binding()
    for name, feed in given.items():
        binding.bind_input(name, "cuda", 0, feed.dtype, list(feed.shape), feed.pointer)
    keep = []
    for spec, shape in zip(runner.outputs, runner.output_shapes(given)):
        if shape is None:
            raise BadInputError(f"output {spec['name']} has a data-dependent shape: CUDA graphs need fixed shapes")
        keep.append(memory.empty(shape, spec["dtype"]))
        binding.bind_output(spec["name"], "cuda", 0, np.dtype(spec["dtype"]), list(shape), keep[-1].data_ptr())

    bound = [feed.value for feed in given.values()]

    def step():
        if copy_from is not None:
            memory.torch._foreach_copy_(bound, copy_from, non_blocking=True)
        runner.session.run_with_iobinding(binding)
        return keep  # the buffers must outlive the captured graph: the step holds them

    return step


def _tensorrt(bundle: runtime.Bundle, device: str, trust_native: bool):
    if not bundle.engines:
        return "the bundle has no engine (convert with --backend tensorrt)"
    if device != "cuda":
        return "TensorRT runs on the GPU only"
    entry = bundle.engines[0]
    problem = runtime.engine_problem_here(entry)
    if problem:
        return problem

    def setup(notes):
        runner = runtime.load_tensorrt_engine(bundle, entry, trust_native=trust_native)
        notes += runner.notes

        return lambda feeds: _synchronized_step(runner, feeds, "cuda")

    return setup


def _aoti(bundle: runtime.Bundle, device: str, trust_native: bool, kind: str):
    """The bundle's AOTI packages of one kind as one runner: static (one per batch size: a batch
    without its own package is not timed) or dynamic (one over the batch range)."""
    if not bundle.aoti:
        return "the bundle has no AOTInductor package (convert with --backend aoti)"
    found = [c for c in find_candidates(bundle, device, trust_native)
             if c.backend == "aoti" and c.options["packages"] == kind and not c.options["cuda_graph"]]
    if not found:
        return f"the bundle has no {kind} AOTInductor package for {device}"
    candidate = found[0]
    if candidate.problem:
        return candidate.problem

    def setup(notes):
        runner = open_runner(bundle, "aoti", {"packages": kind}, device, trust_native=trust_native,
                             allow_unvalidated=True)  # each package's own CUDA graph setting
        notes += runner.notes

        def prepare(feeds: dict) -> Step | None:
            batch = next(iter(feeds.values())).shape[0]
            return _synchronized_step(runner, feeds, device) if candidate.accepts(batch) else None

        return prepare

    return setup


def _openvino(bundle: runtime.Bundle, device: str):
    """The bundle's OpenVINO model (``--backend openvino``), on the CPU only."""
    if not bundle.openvino:  # before finding candidates, which reads the graph and checks packages
        return "the bundle has no OpenVINO model (convert with --backend openvino)"
    candidate = next(c for c in find_candidates(bundle, device) if c.backend == "openvino")
    if candidate.problem:
        return candidate.problem

    def setup(notes):
        runner = open_runner(bundle, "openvino", candidate.options, device)
        notes += runner.notes
        return lambda feeds: _synchronized_step(runner, feeds, device)

    return setup


def _default_load(bundle: runtime.Bundle, device: str, trust_native: bool):
    """What ``deploykit.load(bundle)`` gives users on this device: its tuned choice, the engine or ONNX Runtime."""
    def setup(notes):
        # the bench decided already whether a failed bundle may be timed (--allow-failed)
        runner = runtime.load(bundle.path, device=device, trust_native=trust_native, allow_failed=True,
                              allow_unvalidated=True)
        notes += runner.notes
        return lambda feeds: _synchronized_step(runner, feeds, device)

    return setup


def _synchronized_step(runner, feeds: dict, device: str) -> Step:
    """A runner that may work on its own stream, followed by a device sync so the step is one whole inference."""
    given, sync = (dict(zip(feeds, _torch_feeds(feeds, "cuda"))), _synchronize("cuda")) if device == "cuda" \
        else (feeds, _synchronize(device))
    return lambda: (runner.run(given), sync())


# --------------------------------------------------------------------------- measuring


def add_ratios(entries: list[dict]) -> None:
    """``vs_fastest``: p50 latency over the fastest contender's at the same batch size (1.0 = fastest).
    ``vs_reduce_overhead``: over torch.compile(mode="reduce-overhead")'s in the contender's precision
    (:data:`PYTORCH_PRECISION`: fp16 for fp8, fp32 for int8) at that batch size (below 1: faster than it), None where that one did not run."""
    best: dict[int, float] = {}
    for entry in entries:
        for result in entry["results"]:
            best[result["batch"]] = min(best.get(result["batch"], float("inf")), result["p50_ms"])
    baselines = {(entry["precision"], r["batch"]): r["p50_ms"] for entry in entries for r in entry["results"]
                 if entry["key"] == _reduce_overhead_key(entry["precision"])}
    for entry in entries:
        for result in entry["results"]:
            result["vs_fastest"] = result["p50_ms"] / best[result["batch"]]
            baseline = baselines.get((PYTORCH_PRECISION[entry["precision"]], result["batch"]))
            result["vs_reduce_overhead"] = result["p50_ms"] / baseline if baseline else None


def _reduce_overhead_key(precision: str) -> str:
    return REDUCE_OVERHEAD if precision == "fp32" else f"{REDUCE_OVERHEAD}-{precision}"


@dataclasses.dataclass
class Ready:
    """A contender set up for one batch size: its step, and what getting there cost."""

    entry: dict
    step: Step
    facts: dict


def progress_steps(settings: Settings, found: list[Contender]) -> int:
    """How many times ``run_benchmark`` ticks: per batch size, each contender's set-up and each round."""
    runnable = sum(contender.setup is not None for contender in found)
    return len(settings.batch_sizes) * (runnable + len(calls_per_round(settings)))


def bench_batch(batch: int, found: list[Contender], entries: list[dict], settings: Settings, specs: list[dict],
                tick) -> None:
    """Every contender set up for ``batch`` (all alive together), timed in interleaved rounds, then
    freed before the next batch size; results and failures go into ``entries``."""
    try:
        _time_side_by_side(_set_up_all(batch, found, entries, settings, specs, tick), batch, settings, tick)
    finally:
        _free()  # the steps lived in the calls above only: nothing here holds them


def _set_up_all(batch: int, found: list[Contender], entries: list[dict], settings: Settings, specs: list[dict],
                tick) -> list[Ready]:
    ready = []
    for contender, entry in zip(found, entries):
        if contender.setup is not None and (one := _set_up(contender, entry, batch, settings, specs, tick)):
            ready.append(one)
    return ready


def _time_side_by_side(ready: list[Ready], batch: int, settings: Settings, tick) -> None:
    timed = interleave([r.step for r in ready], settings, lambda text: tick(f"batch {batch}: {text}"))
    for r, result in zip(ready, timed):
        if result.error is not None:
            _failed(r.entry, batch, result.error)
        else:
            r.entry["results"].append({**summarize(result.rounds, batch), **r.facts})


def _set_up(contender: Contender, entry: dict, batch: int, settings: Settings, specs: list[dict], tick) -> Ready | None:
    """The contender's backend built and its step made and called once for ``batch``; None where it
    does not take this batch (a static package's) or failed (recorded in ``entry``). Its runner's
    notes join the entry's, each once over the batch sizes."""
    tick(f"{contender.label}, batch {batch}: setting up")
    notes: list[str] = []
    try:
        start = time.perf_counter()
        step = contender.setup(notes)(runtime.random_inputs(contender.inputs or specs, batch, settings.seed))
        entry["notes"] += [note for note in dict.fromkeys(notes) if note not in entry["notes"]]
        if step is None:
            entry.setdefault("not_timed", []).append(batch)
            return None
        built = time.perf_counter()
        step()  # first call: compilation, graph capture, lazy initialisation
        return Ready(entry, step, {"setup_s": built - start, "first_call_s": time.perf_counter() - built})
    except UntrustedNativeCode:  # consent is the user's decision, not a backend failing
        raise
    except Exception as error:  # noqa: BLE001 - one backend failing must not end the run
        _failed(entry, batch, error)
        return None


def _failed(entry: dict, batch: int, error: Exception) -> None:
    """A contender broke at one batch size: it is marked failed with the reason; its other sizes stand."""
    entry.update(status="failed", reason=with_reason(entry["reason"], error, f"batch {batch}: "))


def _free() -> None:
    """Drop the batch's backends (sessions, thread pools, CUDA graphs) before the next one is built,
    and torch.compile's caches with them, so the next size is compiled for its own shape."""
    gc.collect()
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


def _entry(contender: Contender) -> dict:
    status = "ok" if contender.setup is not None else "failed" if contender.failed else "skipped"
    return {"key": contender.key, "label": contender.label, "precision": contender.precision, "status": status,
            "reason": contender.reason, "notes": [], "results": []}


def batch_plan(bundle: runtime.Bundle, requested: list[int] | None) -> list[int]:
    dynamic = runtime.batch_sizes(bundle.inputs)
    if requested:
        return sorted(set(requested))
    if dynamic:
        return sorted(set(dynamic))
    first = bundle.inputs[0]["shape"][0]
    return [first if isinstance(first, int) and first > 0 else 1]


def run_benchmark(bundle: runtime.Bundle, settings: Settings, found: list[Contender], tick=lambda text: None) -> dict:
    """Measure every contender and return bench.json's content."""
    entries = [_entry(contender) for contender in found]
    with bench_stream(settings.device, settings.tf32):
        for batch in settings.batch_sizes:
            bench_batch(batch, found, entries, settings, bundle.inputs, tick)
    add_ratios(entries)
    return {
        "bundle": str(bundle.path),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": settings.device,
        "settings": dataclasses.asdict(settings),
        "timing": TIMING[settings.device],
        "versions": tool_versions(),
        "contenders": entries,
    }


def resolve_device(device: str) -> str:
    """auto: cuda when torch can use a GPU here (bench feeds the GPU backends torch tensors), else cpu."""
    kind, _ = runtime.parse_device(device)
    if kind != "auto":
        return kind
    if runtime.has_gpu():
        try:
            import torch

            if torch.cuda.is_available():
                return "cuda"
        except ImportError:
            pass
    return "cpu"


def parse_batches(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise BadInputError(f"--batch {text!r}: give batch sizes like 1,8,32")
    return sizes
