"""What can run a bundle here, each as (backend, options), and the one way to open it.

ONNX Runtime on the CPU; on a GPU, ONNX Runtime's CUDA provider with CUDA graphs on and off (and
NHWC kernels on and off when the graph has convolutions), each TensorRT engine this GPU runs and
each AOTInductor package built for this torch and device. What cannot run here stays in the list
with the reason, so the tuning table says why it was not timed. ``open_runner`` is also what the
tuned runner of ``deploykit.load`` uses, so what was timed is what runs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import onnx

from deploykit.backends.base.runner import Runner
from deploykit.backends.onnxruntime.bundle import load_onnxruntime
from deploykit.backends.onnxruntime.loader import CUDA_EP
from deploykit.backends.tensorrt.bundle import load_tensorrt_engine
from deploykit.backends.tensorrt.compat import engine_problem_here
from deploykit.bundle import trust
from deploykit.bundle.read import Bundle

BACKENDS = ("onnxruntime", "tensorrt", "aoti")


@dataclasses.dataclass
class Candidate:
    """One way to run the bundle here; ``problem`` says why it cannot (then it is not timed).
    ``batch`` is the range it accepts when narrower than the bundle's (a static AOTI package)."""

    backend: str
    options: dict
    label: str
    problem: str | None = None
    batch: tuple[int, int] | None = None

    def accepts(self, batch: int) -> bool:
        return self.batch is None or self.batch[0] <= batch <= self.batch[1]


def ort_keywords() -> set[str]:
    """The keyword arguments this deploykit's ONNX Runtime loader takes (cuda_graph, prefer_nhwc arrived late)."""
    return set(inspect.signature(load_onnxruntime).parameters)


def has_conv(bundle: Bundle) -> bool:
    """Whether the shipped graph (or a function it calls) has a convolution: only then may NHWC kernels help."""
    model = onnx.load(bundle.file(bundle.model), load_external_data=False)
    nodes = [*model.graph.node, *(n for f in model.functions for n in f.node)]
    return any(node.op_type in ("Conv", "ConvTranspose") for node in nodes)


def find_candidates(bundle: Bundle, device: str, trust_native: bool = False) -> list[Candidate]:
    """Every candidate for ``device`` ("cpu" or "cuda"), in a fixed order, skipped ones with their reason."""
    found = _onnxruntime(bundle, device)
    found += [_engine(bundle, entry, device, trust_native) for entry in bundle.engines]
    found += [candidate for entry in bundle.manifest.get("aoti", [])
              for candidate in _aoti(bundle, entry, device, trust_native)]
    return found


def _onnxruntime(bundle: Bundle, device: str) -> list[Candidate]:
    if device == "cpu":
        return [Candidate("onnxruntime", {}, "ONNX Runtime, CPU")]
    import onnxruntime as ort

    if CUDA_EP not in ort.get_available_providers():
        return [Candidate("onnxruntime", {}, "ONNX Runtime, CUDA",
                          f"onnxruntime has no {CUDA_EP} (pip install onnxruntime-gpu)")]
    keywords = ort_keywords()
    graphs = (False, True) if "cuda_graph" in keywords else (None,)
    layouts = (False, True) if has_conv(bundle) else (None,)
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
    if problem is None and trust.engine_needs_consent(bundle, entry, trust_native):
        problem = "its plugins are native code this machine's deploykit did not build (--trust-bundle runs them)"
    return Candidate("tensorrt", {"file": entry["file"]}, f"TensorRT {entry['file']}", problem)


@functools.cache
def aoti_compat():
    """deploykit.backends.aoti.compat, or None where this deploykit has no AOTI backend."""
    try:
        from deploykit.backends.aoti import compat
    except ImportError:
        return None
    return compat


def _aoti(bundle: Bundle, entry: dict, device: str, trust_native: bool) -> list[Candidate]:
    label = f"AOTInductor {entry['file']}"
    accepted = (entry["batch"]["min"], entry["batch"]["max"])
    compat = aoti_compat()
    if compat is None:
        problem = "this deploykit has no AOTInductor backend"
    elif entry["device"] != device:
        problem = f"a {entry['device']} package (timing on {device})"
    else:
        problem = compat.package_problem_here(entry)
    digest = bundle.manifest.get("files", {}).get(entry["file"], {}).get("sha256", "")
    if problem is None and not trust_native and trust.provenance(digest) == trust.FOREIGN:
        problem = "native code this machine's deploykit did not build (--trust-bundle runs it)"
    graphs = (False, True) if entry.get("cuda_graph") and device == "cuda" else (False,)
    return [Candidate("aoti", {"file": entry["file"], "cuda_graph": graph},
                      label + (", CUDA graph" if graph else ""), problem, accepted) for graph in graphs]


def accepted_batches(bundle: Bundle, backend: str, options: dict) -> tuple[int, int] | None:
    """The batch sizes a choice takes when narrower than the bundle's: an AOTI package's range."""
    if backend != "aoti":
        return None
    entry = next(e for e in bundle.manifest.get("aoti", []) if e["file"] == options["file"])
    return entry["batch"]["min"], entry["batch"]["max"]


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
                verify: bool = True, **ort_options) -> Runner:
    """A runner for one candidate; ``ort_options`` (threads, stream, ...) go to ONNX Runtime and
    override the candidate's own (a user's cuda_graph=False wins over the tuned choice)."""
    if backend == "onnxruntime":
        return load_onnxruntime(bundle, device, device_id, verify=verify, notes=notes, trust_native=trust_native,
                                allow_unvalidated=allow_unvalidated, **{**options, **ort_options})
    if backend == "tensorrt":
        entry = next(e for e in bundle.engines if e["file"] == options["file"])
        return load_tensorrt_engine(bundle, entry, device_id, verify=verify, notes=notes, trust_native=trust_native)
    from deploykit.backends.aoti.bundle import load_aoti

    entry = next(e for e in bundle.manifest.get("aoti", []) if e["file"] == options["file"])
    return load_aoti(bundle, entry, device_id, verify=verify, trust_native=trust_native,
                     cuda_graph=options.get("cuda_graph"), notes=notes, allow_unvalidated=allow_unvalidated)
