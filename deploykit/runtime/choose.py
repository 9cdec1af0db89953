"""``load``: which backend runs a bundle here (its engine where this GPU can, its OpenVINO model on a CPU
with OpenVINO, else ONNX Runtime; its AOTInductor packages when asked for)."""

from __future__ import annotations

import warnings
from pathlib import Path

from deploykit.errors import BadInputError, EnvironmentProblem
from deploykit.bundle import trust
from deploykit.bundle.read import Bundle, check_validation, open_bundle
from deploykit.backends.aoti.bundle import load_aoti
from deploykit.backends.base.runner import Runner
from deploykit.backends.onnxruntime import wheels
from deploykit.backends.onnxruntime.bundle import load_onnxruntime
from deploykit.backends.onnxruntime.loader import CUDA_EP
from deploykit.backends.openvino import loader as openvino
from deploykit.backends.openvino.bundle import load_openvino, openvino_entry
from deploykit.backends.tensorrt.bundle import load_tensorrt_engine
from deploykit.backends.tensorrt.compat import engine_problem_here
from deploykit.backends.tensorrt.shim import local_gpus
from deploykit.tuning.route import ORT_HINTS, load_tuned, tuning_problem

BACKENDS = ("auto", "onnxruntime", "tensorrt", "aoti", "openvino")
#: What ``load(..., backend="aoti")`` passes on to the AOTInductor runner.
AOTI_OPTIONS = ("cuda_graph", "packages")


def parse_device(device: str) -> tuple[str, int]:
    kind, _, index = device.partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise BadInputError(f"device {device!r}: use auto, cpu, cuda or cuda:N")
    return kind, int(index or 0)


def ort_has_cuda() -> bool:
    wheels.require()
    import onnxruntime as ort

    return CUDA_EP in ort.get_available_providers()


def choose_backend(bundle: Bundle, backend: str, device: str, trust_native: bool = False) -> tuple[str, str, list[str]]:
    """(backend, device, notes): an engine on the GPU when it can run here (and its plugins may: with
    ``backend="auto"`` a foreign engine with plugins gives way to ONNX Runtime), else on a CPU the bundle's
    OpenVINO model where OpenVINO imports, else ONNX Runtime. ``backend="aoti"`` keeps ``device`` as asked: its loader picks the package for the GPU it runs on."""
    if backend not in BACKENDS:
        raise BadInputError(f"backend {backend!r}: use one of {', '.join(BACKENDS)}")
    notes: list[str] = []
    if backend == "aoti":
        return "aoti", device, notes
    if backend == "openvino":
        if device == "cuda":
            raise BadInputError("OpenVINO runs the bundle on the CPU: use device='cpu' (or backend='onnxruntime')")
        openvino_entry(bundle)  # refuses a bundle without one, saying how to make it
        return "openvino", "cpu", notes
    if backend in ("auto", "tensorrt") and device != "cpu":
        if not bundle.engines:
            if backend == "tensorrt":
                raise BadInputError(f"{bundle.path} has no TensorRT engine: convert with --backend tensorrt")
        else:
            entry = bundle.engines[0]
            problem = engine_problem_here(entry)
            if problem is None and backend == "auto":
                problem = trust.plugins_problem(bundle, entry, trust_native, "trust_native=True / --trust-bundle")
            if problem is None:
                return "tensorrt", "cuda", notes
            if backend == "tensorrt":
                raise EnvironmentProblem(f"cannot run {entry['file']} here: {problem}")
            notes.append(f"TensorRT engine not used: {problem}")
    if backend == "tensorrt":
        raise BadInputError("TensorRT runs on the GPU only: use device='cuda' (or backend='onnxruntime')")
    if device == "auto":
        device = "cuda" if ort_has_cuda() and has_gpu() else "cpu"
    elif device == "cuda" and not ort_has_cuda():
        import onnxruntime as ort

        raise EnvironmentProblem(f"onnxruntime {ort.__version__} has no {CUDA_EP}: pip uninstall onnxruntime && "
                                 "pip install onnxruntime-gpu (or use device='cpu')")
    if backend == "auto" and device == "cpu" and bundle.openvino:
        if openvino.available():
            return "openvino", "cpu", notes
        notes.append(f"OpenVINO model not used: OpenVINO is not installed ({openvino.INSTALL})")
    return "onnxruntime", device, notes


def has_gpu() -> bool:
    return not isinstance(local_gpus(), str)


def auto_device(bundle: Bundle, backend: str = "auto", trust_native: bool = False) -> str:
    """Where ``load(bundle, backend, device="auto")`` runs the bundle, ``cuda`` or ``cpu``, decided without
    loading it: ``serve --workers auto`` sizes its HTTP processes by it before the model process loads."""
    if backend == "openvino" or not has_gpu():
        return "cpu"
    if backend in ("aoti", "tensorrt"):
        return "cuda"
    tuning = bundle.manifest.get("tuning")
    if backend == "auto" and tuning and tuning_problem(tuning, "cuda") is None:
        return "cuda"
    return choose_backend(bundle, backend, "auto", trust_native)[1]


def load(bundle: str | Path | Bundle, backend: str = "auto", device: str = "auto", *, allow_failed: bool = False,
         op_library: bool = True, verify: bool = True, allow_unvalidated: bool = False, trust_native: bool = False,
         **options) -> Runner:
    """Open a bundle (or take one opened by ``open_bundle``, whose files verified once are not hashed
    again: several runners of one bundle) and return a runner for it.

    ``backend``: auto (the fastest validated choice per batch size where the bundle was tuned on a
    machine like this one, docs/tuning.md; else the engine where this GPU runs it, else on a CPU the
    bundle's OpenVINO model where OpenVINO is installed, else ONNX Runtime), onnxruntime, tensorrt,
    openvino or aoti (the bundle's AOTInductor packages: cuda ones on a GPU, else cpu ones).
    ``device``: auto, cpu, cuda or cuda:N. Files are checked against the manifest's
    sha256 (``verify=False`` skips it). Native code from the bundle (its op library, an engine's
    plugins) runs only when this machine's deploykit made it, or with ``trust_native=True``
    (else a foreign op library is swapped for this machine's build, or refused). A bundle that
    failed validation raises ValidationFailed unless ``allow_failed``. A batch outside the range
    the bundle was validated for raises BadInputError unless ``allow_unvalidated`` (ONNX Runtime
    then runs it and says so in ``runner.notes``; an engine runs only the batches it was built
    for). ``options`` go to the runner (ONNX Runtime:
    threads, spin, cuda_graph, stream, tf32, profile_prefix; AOTInductor: cuda_graph, packages; OpenVINO:
    threads). Why a backend was chosen and what differs from the conversion machine are in
    ``runner.notes``; the latter are also issued as warnings.
    """
    opened = bundle if isinstance(bundle, Bundle) else open_bundle(bundle)
    check_validation(opened, allow_failed)
    kind, device_id = parse_device(device)
    notes: list[str] = []
    if backend == "auto" and opened.manifest.get("tuning"):
        here = kind if kind != "auto" else ("cuda" if has_gpu() else "cpu")
        tuned = load_tuned(opened, here, device_id, notes, trust_native=trust_native, verify=verify,
                           allow_unvalidated=allow_unvalidated, op_library=op_library, **options)
        if tuned is not None:
            return _warned(tuned)
    chosen, kind, choice_notes = choose_backend(opened, backend, kind, trust_native)
    if chosen == "onnxruntime":
        wheels.require()
    notes += choice_notes
    if chosen == "aoti":
        unknown = sorted(set(options) - set(AOTI_OPTIONS))
        if unknown:
            raise BadInputError(f"{', '.join(unknown)} do not apply to AOTInductor packages (options: "
                                f"{', '.join(AOTI_OPTIONS)})")
        runner = load_aoti(opened, None, device_id, device=kind, verify=verify, trust_native=trust_native,
                           notes=notes, allow_unvalidated=allow_unvalidated, **options)
    elif chosen == "openvino":
        given = {name: value for name, value in options.items() if name not in ORT_HINTS}
        unknown = sorted(set(given) - set(openvino.OPTIONS))
        if unknown:
            raise BadInputError(f"{', '.join(unknown)} do not apply to OpenVINO (options: {', '.join(openvino.OPTIONS)})")
        runner = load_openvino(opened, verify=verify, notes=notes, allow_unvalidated=allow_unvalidated, **given)
    elif chosen == "tensorrt":
        if options:
            raise BadInputError(f"{', '.join(options)} apply to ONNX Runtime only; this bundle runs its TensorRT engine")
        runner = load_tensorrt_engine(opened, opened.engines[0], device_id, verify=verify, notes=notes,
                                      trust_native=trust_native)
    else:
        runner = load_onnxruntime(opened, kind, device_id, op_library=op_library, verify=verify, notes=notes,
                                  allow_unvalidated=allow_unvalidated, trust_native=trust_native, **options)
    return _warned(runner)


def _warned(runner: Runner) -> Runner:
    for note in runner.warnings:
        warnings.warn(note, RuntimeWarning, stacklevel=3)
    return runner
