"""``deploykit profile``: where the time goes, layer by layer, in each backend that runs here.

ONNX Runtime's own profiler (per node, with the execution provider), TensorRT's IProfiler (per
engine layer, where an engine runs), and the PyTorch profiler on the source model (per
module, when it is given). Each becomes the same shape -- layers sorted by total time, op-type
totals and one run's timeline -- with deploykit's custom ops (domain ``deploykit``) flagged,
so their share is visible next to everything else.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import json
import re
import tempfile
import time
from pathlib import Path

from deploykit import runtime
from deploykit.bundle.trust import UntrustedNativeCode
from deploykit.errors import error_summary
from deploykit.native.stderr import captured_stderr


@dataclasses.dataclass
class Settings:
    batch: int | None = None
    device: str = "cpu"
    warmup: int = 3
    iterations: int = 20
    seed: int = 0
    op_library: bool = True
    trust_native: bool = False  # load the bundle's native code even where this machine did not build it


def layer_table(samples: dict[str, list[float]], kinds: dict[str, tuple[str, str, bool]], runs: int) -> list[dict]:
    """Per-layer rows from {layer: [ms per call]} and {layer: (op type, where, custom)}, costliest first."""
    total = sum(sum(times) for times in samples.values()) or 1.0
    rows = []
    for name, times in samples.items():
        op_type, where, custom = kinds.get(name, ("?", "", False))
        rows.append({"name": name, "op_type": op_type, "where": where, "custom": custom, "calls": len(times),
                     "total_ms": sum(times), "per_run_ms": sum(times) / max(runs, 1),
                     "share": sum(times) / total})
    return sorted(rows, key=lambda row: row["total_ms"], reverse=True)


def op_type_table(layers: list[dict]) -> list[dict]:
    totals: dict[str, dict] = {}
    for layer in layers:
        entry = totals.setdefault(layer["op_type"], {"op_type": layer["op_type"], "custom": layer["custom"],
                                                     "layers": 0, "total_ms": 0.0, "per_run_ms": 0.0, "share": 0.0})
        entry["layers"] += 1
        for key in ("total_ms", "per_run_ms", "share"):
            entry[key] += layer[key]
    return sorted(totals.values(), key=lambda row: row["total_ms"], reverse=True)


def finish(backend: str, layers: list[dict], timeline: list[dict], runs: int, note: str = "",
           notes: list[str] | None = None) -> dict:
    """One backend's section; ``notes``: its runner's (what differs from the conversion), as ``run`` prints them."""
    custom = sum(layer["share"] for layer in layers if layer["custom"])
    return {"backend": backend, "status": "ok", "runs": runs, "note": note, "notes": list(notes or []),
            "layers": layers, "op_types": op_type_table(layers), "timeline": timeline, "custom_share": custom,
            "per_run_ms": sum(layer["total_ms"] for layer in layers) / max(runs, 1)}


# --------------------------------------------------------------------------- ONNX Runtime


def graph_nodes(model_path: Path) -> dict[str, tuple[str, str]]:
    """{node name: (op type, domain)} of the bundle's graph, without loading external weights."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    return {node.name: (node.op_type, node.domain) for node in model.graph.node}


def profile_onnxruntime(bundle: runtime.Bundle, feeds: dict, settings: Settings) -> dict:
    """Run with ORT's profiler on; keep the node events inside the timed runs (not the warm-up)."""
    with tempfile.TemporaryDirectory(prefix="deploykit-profile-") as work:
        runner = runtime.load_onnxruntime(bundle, settings.device, op_library=settings.op_library,
                                          trust_native=settings.trust_native, allow_unvalidated=True,  # timing only
                                          profile_prefix=str(Path(work) / "ort"))
        for _ in range(settings.warmup + settings.iterations):
            runner.run(feeds)
        events = json.loads(Path(runner.end_profiling()).read_text())
    nodes = graph_nodes(runner.model_path)
    runs = sorted((e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"), key=lambda e: e["ts"])
    timed = runs[settings.warmup:]
    samples, kinds, timeline = collections.defaultdict(list), {}, []
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        run = next((r for r in timed if r["ts"] <= event["ts"] <= r["ts"] + r["dur"]), None)
        if run is None:
            continue
        name = event["name"].removesuffix("_kernel_time")
        op_type, domain = nodes.get(name, (event["args"].get("op_name", "?"), ""))
        custom = domain == "deploykit"
        kinds[name] = (f"deploykit::{op_type}" if custom else op_type, event["args"].get("provider", ""), custom)
        samples[name].append(event["dur"] / 1e3)
        if run is timed[-1]:
            timeline.append({"name": name, "op_type": kinds[name][0], "start_us": event["ts"] - run["ts"],
                             "duration_us": event["dur"], "custom": custom})
    library = runner.library.name if runner.library else "no op library: deploykit ops run as inlined ONNX functions"
    return finish(f"onnxruntime ({runner.provider})", layer_table(samples, kinds, len(timed)), timeline, len(timed),
                  note=library, notes=runner.notes)


# --------------------------------------------------------------------------- TensorRT


def profile_tensorrt(bundle: runtime.Bundle, feeds: dict, settings: Settings) -> dict:
    """TensorRT's IProfiler: per-layer times of each synchronous run (layers of a run are sequential)."""
    runner = runtime.load_tensorrt_engine(bundle, bundle.engines[0], trust_native=settings.trust_native)
    trt = runner.flavour.module
    plugins = {layer["name"] for layer in bundle.engines[0].get("plugin_layer_list", [])}

    class LayerTimes(trt.IProfiler):
        def __init__(self):
            trt.IProfiler.__init__(self)
            self.runs: list[list[tuple[str, float]]] = []

        def report_layer_time(self, layer_name, ms):
            self.runs[-1].append((layer_name, ms))

    profiler = LayerTimes()
    for _ in range(settings.warmup):
        runner.run(feeds)
    runner.context.profiler = profiler
    for _ in range(settings.iterations):
        profiler.runs.append([])
        runner.run(feeds)
    samples, kinds = collections.defaultdict(list), {}
    for run in profiler.runs:
        for name, ms in run:
            custom = any(plugin in name for plugin in plugins)
            samples[name].append(ms)
            kinds[name] = ("deploykit plugin" if custom else "TensorRT layer", runner.flavour.label, custom)
    timeline, clock = [], 0.0
    for name, ms in profiler.runs[-1] if profiler.runs else []:
        timeline.append({"name": name, "op_type": kinds[name][0], "start_us": clock * 1e3, "duration_us": ms * 1e3,
                         "custom": kinds[name][2]})
        clock += ms
    return finish(f"tensorrt ({runner.flavour.label})", layer_table(samples, kinds, len(profiler.runs)), timeline,
                  len(profiler.runs), note="layer times reported by IProfiler; the timeline lays them end to end",
                  notes=runner.notes)


# --------------------------------------------------------------------------- PyTorch


def profile_torch(loaded, feeds: dict, settings: Settings) -> dict:
    """The PyTorch profiler with one record_function range per leaf module (per aten op for
    TorchScript and exported programs, which have no leaf modules to hook)."""
    import torch

    from deploykit.tools.bench import cast_feeds

    module = loaded.module.to(settings.device)
    args = [tensor.to(settings.device) for tensor in cast_feeds(feeds).values()]
    handles, labels = _hook_leaf_modules(module, settings.device == "cuda")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if settings.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.inference_mode():
        for _ in range(settings.warmup):
            module(*args)
        with captured_stderr([], show=lambda line: not _KINETO_LINE.match(line)), torch.profiler.profile(activities=activities) as prof:
            for _ in range(settings.iterations):
                with torch.profiler.record_function("deploykit.run"):
                    module(*args)
    for handle in handles:
        handle.remove()
    events = [e for e in prof.events() if (e.name in labels if labels else e.name.startswith("aten::"))]
    if labels:
        events = _outermost(events)
    samples, kinds = collections.defaultdict(list), {}
    for event in events:
        samples[event.name].append(event.time_range.elapsed_us() / 1e3 if labels else event.self_cpu_time_total / 1e3)
        kinds[event.name] = (labels.get(event.name, event.name), "pytorch", False)
    runs = [e for e in prof.events() if e.name == "deploykit.run"]
    last = runs[-1].time_range if runs else None
    timeline = [{"name": e.name, "op_type": kinds[e.name][0], "start_us": e.time_range.start - last.start,
                 "duration_us": e.time_range.elapsed_us(), "custom": False}
                for e in events if last and last.start <= e.time_range.start <= last.end]
    note = "per leaf module (record_function ranges)" if labels else "per aten op (self CPU time): no leaf modules to hook"
    return finish(f"pytorch ({settings.device})", layer_table(samples, kinds, settings.iterations), timeline,
                  settings.iterations, note=note)


_KINETO_LINE = re.compile(r"^(USDT|ERROR|WARNING|INFO):\d{4}-\d\d-\d\d .*\.cpp:\d+\]")


def _hook_leaf_modules(module, synchronize: bool):
    """Open a record_function range before each leaf module runs and close it after."""
    import torch

    if isinstance(module, torch.jit.ScriptModule):
        return [], {}
    handles, labels = [], {}
    for name, child in module.named_modules():
        if list(child.children()) or not name:
            continue
        label = f"{name}"
        labels[label] = type(child).__name__

        def enter(_module, _inputs, label=label):
            _module._deploykit_range = torch.profiler.record_function(label)
            _module._deploykit_range.__enter__()

        def leave(_module, _inputs, _output):
            if synchronize:
                torch.cuda.synchronize()
            _module._deploykit_range.__exit__(None, None, None)

        handles += [child.register_forward_pre_hook(enter), child.register_forward_hook(leave)]
    return handles, labels


def _outermost(events: list) -> list:
    """A module called inside another leaf's range is not double counted (rare: shared modules)."""
    ordered = sorted(events, key=lambda e: e.time_range.start)
    kept, end = [], -1.0
    for event in ordered:
        if event.time_range.start >= end:
            kept.append(event)
            end = event.time_range.end
    return kept


# --------------------------------------------------------------------------- the whole profile


def run_profile(bundle: runtime.Bundle, settings: Settings, source=None, only: set[str] | None = None,
                stage=None) -> dict:
    """Profile every backend that can run here; what cannot is listed with the reason."""
    stage = stage or (lambda title: contextlib.nullcontext())
    feeds = runtime.random_inputs(bundle.inputs, settings.batch, settings.seed)
    sections = []
    for key, reason, work in _plan(bundle, settings, source, feeds):
        if only is not None and key not in only:
            continue
        if reason:
            sections.append({"backend": key, "status": "skipped", "reason": reason})
            continue
        with stage(f"Profiling {key}"):
            try:
                sections.append(work())
            except UntrustedNativeCode:  # consent is the user's decision, not a backend failing
                raise
            except Exception as error:  # noqa: BLE001 - one backend failing must not end the run
                sections.append({"backend": key, "status": "failed", "reason": error_summary(error)[:300]})
    return {"bundle": str(bundle.path), "device": settings.device, "batch": next(iter(feeds.values())).shape[0],
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "settings": dataclasses.asdict(settings), "sections": sections}


def _plan(bundle: runtime.Bundle, settings: Settings, source, feeds: dict):
    """(key, reason it cannot run or "", work) for ONNX Runtime, TensorRT and PyTorch."""
    yield "onnxruntime", _ort_reason(settings.device), lambda: profile_onnxruntime(bundle, feeds, settings)
    yield "tensorrt", _trt_reason(bundle, settings.device), lambda: profile_tensorrt(bundle, feeds, settings)
    reason = "" if source is not None and source.loaded is not None else (source.reason if source else "no --model")
    yield "pytorch", reason, lambda: profile_torch(source.loaded, feeds, settings)


def _ort_reason(device: str) -> str:
    if device == "cuda" and not runtime.ort_has_cuda():
        return f"onnxruntime has no {runtime.CUDA_EP} (pip install onnxruntime-gpu)"
    return ""


def _trt_reason(bundle: runtime.Bundle, device: str) -> str:
    if not bundle.engines:
        return "the bundle has no engine (convert with --backend tensorrt)"
    if device != "cuda":
        return "TensorRT runs on the GPU only"
    return runtime.engine_problem_here(bundle.engines[0]) or ""


def render_html(profile: dict, top: int = 20) -> str:
    """profile.html: per backend a chart of the top costs, a timeline of one run and the sorted table."""
    from deploykit.report.bench_plots import cost_bars_png, timeline_png
    from deploykit.report.html import png_base64 as encode, render

    charts = {}
    for section in profile["sections"]:
        if section["status"] == "ok" and section["layers"]:
            name, types, layers = section["backend"], section["op_types"][:top], section["layers"][:top]
            charts[name] = {
                "types": encode(cost_bars_png(types, [t["op_type"] for t in types], f"{name}: time by op type")),
                "top": encode(cost_bars_png(layers, [f"{r['name'][:48]} ({r['op_type']})" for r in layers],
                                            f"{name}: top {len(layers)} layers")),
                "timeline": encode(timeline_png(section["timeline"], f"{name}: one run")),
            }
    return render("profile.html.j2", profile=profile, charts=charts, top=top,
                  generated=time.strftime("%Y-%m-%d %H:%M:%S"))
