"""What can run a bundle here, each as (backend, options), and the one way to open it.

ONNX Runtime on the CPU; on a GPU, ONNX Runtime's CUDA provider with CUDA graphs on and off (and
NHWC kernels on and off when the graph has convolutions), each TensorRT engine this GPU runs and
the AOTInductor packages built for this torch and device (static ones, the dynamic one), and on the CPU
the bundle's OpenVINO models. What cannot run here stays in the list
with the reason, so the tuning table says why it was not timed. ``open_runner`` is also what the
tuned runner of ``deploykit.load`` uses, so what was timed is what runs.
"""

from __future__ import annotations

import dataclasses
import inspect

import onnx

from deploykit.backends.aoti.bundle import load_aoti, packages_of
from deploykit.backends.aoti.compat import PackageChecks
from deploykit.backends.base.runner import Runner
from deploykit.backends.onnxruntime.bundle import load_onnxruntime
from deploykit.backends.onnxruntime.loader import CUDA_EP
from deploykit.backends.openvino import loader as openvino
from deploykit.backends.openvino.bundle import load_openvino, openvino_entry
from deploykit.backends.tensorrt.bundle import load_tensorrt_engine
from deploykit.backends.tensorrt.compat import engine_problem_here
from deploykit.bundle import trust
from deploykit.bundle.read import Bundle

BACKENDS = ("onnxruntime", "tensorrt", "aoti", "openvino")


@dataclasses.dataclass
class Candidate:
    """One way to run the bundle here; ``problem`` says why it cannot (then it is not timed).
    ``batch`` holds the ranges it accepts when narrower than the bundle's (AOTI packages: a static
    one takes only its own batch size)."""

    backend: str
    options: dict
    label: str
    problem: str | None = None
    batch: list[tuple[int, int]] | None = None

    def accepts(self, batch: int) -> bool:
        return takes(self.batch, batch)


def takes(ranges: list[tuple[int, int]] | None, batch: int) -> bool:
    """Whether ``batch`` lies in one of ``ranges`` (None: any batch of the bundle)."""
    return ranges is None or any(low <= batch <= high for low, high in ranges)


def ort_keywords() -> set[str]:
    """The keyword arguments this deploykit's ONNX Runtime loader takes (cuda_graph, prefer_nhwc arrived late)."""
    return set(inspect.signature(load_onnxruntime).parameters)


def has_conv(bundle: Bundle) -> bool:
    """Whether the shipped graph (or a function it calls) has a convolution: only then may NHWC kernels help."""
    model = onnx.load(bundle.file(bundle.model), load_external_data=False)
    nodes = [*model.graph.node, *(n for f in model.functions for n in f.node)]
    return any(node.op_type in ("Conv", "ConvTranspose") for node in nodes)


def find_candidates(bundle: Bundle, device: str, trust_native: bool = False, device_id: int = 0,
                    checks: PackageChecks | None = None, *, convolutions: bool | None = None) -> list[Candidate]:
    """Every candidate for ``device`` ("cpu" or "cuda"), in a fixed order, skipped ones with their reason.
    ``checks``: the AOTInductor packages' problems, shared with the loader that opens the choice;
    ``convolutions``: whether the graph has any, where the caller knows (None: the graph is read)."""
    found = _onnxruntime(bundle, device, convolutions)
    found += [_engine(bundle, entry, device, trust_native) for entry in bundle.engines]
    found += _aoti(bundle, device, trust_native, checks or PackageChecks(device_id))
    return found + [_openvino(entry, device) for entry in bundle.openvino]


def _onnxruntime(bundle: Bundle, device: str, convolutions: bool | None) -> list[Candidate]:
    if device == "cpu":
        return [Candidate("onnxruntime", {}, "ONNX Runtime, CPU")]
    import onnxruntime as ort

    if CUDA_EP not in ort.get_available_providers():
        return [Candidate("onnxruntime", {}, "ONNX Runtime, CUDA",
                          f"onnxruntime has no {CUDA_EP} (pip install onnxruntime-gpu)")]
    keywords = ort_keywords()
    graphs = (False, True) if "cuda_graph" in keywords else (None,)
    layouts = (False, True) if (has_conv(bundle) if convolutions is None else convolutions) else (None,)
    found = []
    for graph in graphs:
        for nhwc in layouts:
            problem = "this deploykit's ONNX Runtime loader has no prefer_nhwc" \
                if nhwc and "prefer_nhwc" not in keywords else None
            options = {key: value for key, value in (("cuda_graph", graph), ("prefer_nhwc", nhwc))
                       if value is not None and (key in keywords or problem)}
            found.append(Candidate("onnxruntime", options, _ort_label(options), problem))
    return found


def _ort_label(options: dict) -> str:
    parts = ["CUDA graph" if options.get("cuda_graph") else "no CUDA graph"]
    if options.get("prefer_nhwc"):
        parts.append("NHWC")
    return f"ONNX Runtime, CUDA, {', '.join(parts)}"


def _engine(bundle: Bundle, entry: dict, device: str, trust_native: bool) -> Candidate:
    problem = "TensorRT runs on the GPU only" if device != "cuda" else engine_problem_here(entry)
    problem = problem or trust.plugins_problem(bundle, entry, trust_native)
    return Candidate("tensorrt", {"file": entry["file"]}, f"TensorRT {entry['file']}", problem)


def _openvino(entry: dict, device: str) -> Candidate:
    problem = "OpenVINO runs on the CPU only" if device != "cpu" else None
    if problem is None and not openvino.available():
        problem = f"OpenVINO is not installed ({openvino.INSTALL})"
    return Candidate("openvino", {"file": entry["file"]}, f"OpenVINO {entry['file']}", problem)


def _aoti(bundle: Bundle, device: str, trust_native: bool, checks: PackageChecks) -> list[Candidate]:
    """One candidate per package kind of this device: the static packages (one per batch size,
    each taking only its own) and the dynamic one, with and without CUDA graphs where allowed."""
    found = []
    for kind in ("static", "dynamic"):
        kept = packages_of(bundle, device, kind)
        if not kept:
            continue
        problems = [checks.problem(e) for e in kept]
        runnable = [e for e, problem in zip(kept, problems) if problem is None]
        problem = None if runnable else problems[0]
        if any(trust.is_foreign(bundle, e["file"]) for e in runnable) and not trust_native:
            problem = "native code this machine's deploykit did not build (--trust-bundle runs it)"
        ranges = [(e["batch"]["min"], e["batch"]["max"]) for e in runnable or kept]
        graphs = (False, True) if device == "cuda" and any(e.get("cuda_graph") for e in runnable) else (False,)
        files = ", ".join(e["file"] for e in kept)
        found += [Candidate("aoti", {"packages": kind, "cuda_graph": graph},
                            f"AOTInductor {kind} ({files}){', CUDA graph' if graph else ''}", problem, ranges)
                  for graph in graphs]
    return found


def accepted_batches(here: list[Candidate], backend: str, options: dict) -> list[tuple[int, int]] | None:
    """The batch ranges a choice takes when narrower than the bundle's (AOTI packages'), from ``here``."""
    return next((c.batch for c in here if c.backend == backend and c.options == options), None)


def choice_problem(here: list[Candidate], backend: str, options: dict) -> str | None:
    """Why a recorded choice cannot run here (None: it can), by the same rules as the candidates
    (``here``: :func:`find_candidates` on this machine)."""
    for candidate in here:
        if candidate.backend == backend and candidate.options == options:
            return candidate.problem
    if backend == "onnxruntime" and set(options) <= ort_keywords():
        return None  # an option set the loader takes, though not one the candidates list (say on another provider)
    return f"{backend} with {options or 'no options'} is not among what can run here"


def open_runner(bundle: Bundle, backend: str, options: dict, device: str, device_id: int = 0, *,
                trust_native: bool = False, notes: list[str] | None = None, allow_unvalidated: bool = False,
                verify: bool = True, checks: PackageChecks | None = None, **ort_options) -> Runner:
    """A runner for one candidate; ``ort_options`` (threads, stream, ...) go to ONNX Runtime and
    override the candidate's own (a user's cuda_graph=False wins over the tuned choice); ``checks``:
    the AOTInductor packages' problems as :func:`find_candidates` found them."""
    if backend == "onnxruntime":
        return load_onnxruntime(bundle, device, device_id, verify=verify, notes=notes, trust_native=trust_native,
                                allow_unvalidated=allow_unvalidated, **{**options, **ort_options})
    if backend == "tensorrt":
        entry = next(e for e in bundle.engines if e["file"] == options["file"])
        return load_tensorrt_engine(bundle, entry, device_id, verify=verify, notes=notes, trust_native=trust_native)
    if backend == "openvino":
        return load_openvino(bundle, openvino_entry(bundle, options["file"]), verify=verify, notes=notes,
                             allow_unvalidated=allow_unvalidated, threads=ort_options.get("threads"))
    return load_aoti(bundle, None, device_id, device=device, checks=checks, verify=verify, trust_native=trust_native,
                     cuda_graph=options.get("cuda_graph"), notes=notes, allow_unvalidated=allow_unvalidated,
                     packages=options["packages"])
