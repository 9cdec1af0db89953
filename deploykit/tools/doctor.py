"""``deploykit doctor [BUNDLE]``: why a model will not run here, and what to do about it.

Facts are gathered once (``gather``: driver, GPUs, torch, nvcc, ONNX Runtime, TensorRT,
cuda-python, our libraries, where a bundle's native files come from) into an ``Environment``;
each check is a pure function of it (and of a bundle's manifest), so the rules -- e.g. "no
kernel image is available" when torch was not built for this GPU, TensorRT-RTX refusing Hopper --
are tested without the hardware.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.metadata
import json
import re
import shutil
import subprocess
from pathlib import Path

from deploykit import runtime
from deploykit.backends.onnxruntime import loader, wheels
from deploykit.backends.openvino.loader import EXTRA as OPENVINO_EXTRA
from deploykit.bundle import trust
from deploykit.bundle.read import FileProblem
from deploykit.errors import DeployKitError

TORCH_INDEX = "pip install torch --index-url https://download.pytorch.org/whl/cu{cuda}"


@dataclasses.dataclass
class Check:
    """One line of the doctor's table: ok, warn, fail or skip, with the fix for a problem."""

    area: str
    status: str
    detail: str
    fix: str = ""


@dataclasses.dataclass
class Environment:
    """What this machine has. ``gpus``: ((name, "major.minor"), ...) or why there are none."""

    driver: str | None = None
    driver_cuda: str | None = None
    gpus: tuple | str = "not checked"
    torch: dict | None = None
    nvcc: str | None = None
    onnxruntime: dict | None = None
    tensorrt: dict = dataclasses.field(default_factory=dict)  # flavour -> version, or "error: why"
    rtx_targets: tuple[str, ...] | None = None
    cuda_python: str | None = None
    openvino: dict = dataclasses.field(default_factory=dict)  # distribution -> version: openvino, nncf
    libraries: dict = dataclasses.field(default_factory=dict)  # library -> "ok" or why it fails to load
    native: list = dataclasses.field(default_factory=list)  # the bundle's native files (trust.NativeFile)
    substitutes: dict = dataclasses.field(default_factory=dict)  # bundle file -> this machine's build used for it


# --------------------------------------------------------------------------- gathering facts


def gather(bundle: runtime.Bundle | None = None, trust_native: bool = False) -> Environment:
    from deploykit.backends.tensorrt.shim import local_gpus

    env = Environment(gpus=local_gpus(), torch=_torch_facts(), nvcc=_nvcc_version(),
                      onnxruntime=_ort_facts(), cuda_python=_distribution("cuda-bindings", "cuda-python"))
    env.driver, env.driver_cuda = _driver_facts()
    env.openvino = {name: version for name in ("openvino", "nncf") if (version := _distribution(name))}
    for flavour in ("tensorrt", "tensorrt-rtx"):
        version, targets = runtime.installed_tensorrt(flavour)
        if version:
            env.tensorrt[flavour] = version
            env.rtx_targets = targets or env.rtx_targets
    env.libraries, env.substitutes = _library_facts(bundle, trust_native)
    env.native = trust.native_files(bundle) if bundle is not None else []
    return env


def _distribution(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _driver_facts() -> tuple[str | None, str | None]:
    """(driver version from NVML, CUDA version the driver supports from libcuda)."""
    driver = cuda = None
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        buffer = ctypes.create_string_buffer(96)
        if nvml.nvmlInit_v2() == 0 and nvml.nvmlSystemGetDriverVersion(buffer, 96) == 0:
            driver = buffer.value.decode()
    except OSError:
        pass
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            cuda = f"{version.value // 1000}.{version.value % 1000 // 10}"
    except OSError:
        pass
    return driver, cuda


def _torch_facts() -> dict | None:
    if _distribution("torch") is None:
        return None
    import torch

    return {"version": torch.__version__, "cuda": torch.version.cuda, "archs": list(torch.cuda.get_arch_list()),
            "available": torch.cuda.is_available()}


def _nvcc_version() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    output = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"release (\d+\.\d+)", output)
    return match.group(1) if match else "unknown"


def _ort_facts() -> dict | None:
    """The ONNX Runtime wheels installed ({name: version}, from their metadata: a mix of both may not
    import) and, when it imports, its version and providers; None when there is none."""
    installed = wheels.installed()
    try:
        import onnxruntime as ort
    except ImportError as error:
        if not installed:
            return None
        return {"version": None, "providers": [], "distributions": installed, "error": str(error).splitlines()[0]}
    return {"version": ort.__version__, "providers": ort.get_available_providers(), "distributions": installed}


def _library_facts(bundle: runtime.Bundle | None, trust_native: bool = False) -> tuple[dict[str, str], dict[str, str]]:
    """(whether our libraries load here, {bundle file: this machine's build used in its place}): the
    bundle's op library, else the newest cached build's."""
    if bundle is not None and bundle.op_library:
        return _bundle_library_facts(bundle, trust_native)
    libraries = {}
    if (build := _newest_build()) is not None:
        for name, relative in build.get("libraries", {}).items():
            path = build["dir"] / relative
            libraries[f"{path.name} ({build['dir']})"] = (_ort_library_loads(path) if name == "onnxruntime"
                                                          else _dlopen(path))
    return libraries, {}


def _bundle_library_facts(bundle: runtime.Bundle, trust_native: bool) -> tuple[dict[str, str], dict[str, str]]:
    """The library a load would register for the bundle, as the trust decision picks it (its own, or
    this machine's build for a foreign one), tried; nothing when refused: check_native says why."""
    name = bundle.op_library["file"]
    try:
        path = trust.op_library(bundle, trust_native=trust_native)
    except FileProblem as problem:
        return {f"bundle {name}": problem.kind}, {}
    except trust.UntrustedNativeCode:
        return {}, {}
    if path.parent == bundle.path:
        return {f"bundle {name}": _ort_library_loads(path)}, {}
    return {f"{path.name} (this machine's build, for the bundle's)": _ort_library_loads(path)}, {name: str(path)}


def _newest_build() -> dict | None:
    from deploykit.native import build as native

    manifests = sorted((native.cache_dir() / "build").glob(f"*/{native.MANIFEST}"), key=lambda p: p.stat().st_mtime)
    if not manifests:
        return None
    return {**json.loads(manifests[-1].read_text()), "dir": manifests[-1].parent}


def _ort_library_loads(path: Path) -> str:
    """"ok", or why ONNX Runtime will not take the op library: registered through the loader, as
    every session registers it, so doctor tries what a run would do."""
    try:
        loader.session_options(op_library=path)
        return "ok"
    except (DeployKitError, ImportError) as error:
        return str(error)


def _dlopen(path: Path) -> str:
    try:
        ctypes.CDLL(str(path))
        return "ok"
    except OSError as error:
        return str(error)[:200]


# --------------------------------------------------------------------------- checks


def check_gpu(env: Environment) -> list[Check]:
    if isinstance(env.gpus, str):
        return [Check("GPU", "skip", f"{env.gpus}: CPU only (ONNX Runtime on the CPU still runs bundles)",
                      "install the NVIDIA driver to use a GPU")]
    driver = f"driver {env.driver or '?'}, supports CUDA {env.driver_cuda or '?'}"
    return [Check("GPU", "ok", f"{name} (compute capability {cc}); {driver}") for name, cc in env.gpus]


def torch_runs_on(archs: list[str], capability: str) -> bool:
    """Whether torch's compiled architectures cover a GPU: SASS sm_XY runs on X.Y' with Y' >= Y
    (same major); PTX compute_XY is JIT-compiled for any capability >= X.Y."""
    major, minor = (int(p) for p in capability.split("."))
    for arch in archs:
        match = re.fullmatch(r"(sm|compute)_(\d+?)(\d)(a|f)?", arch)
        if not match:
            continue
        kind, a_major, a_minor, suffix = match.group(1), int(match.group(2)), int(match.group(3)), match.group(4)
        if suffix == "a" and (a_major, a_minor) != (major, minor):
            continue
        if kind == "sm" and a_major == major and a_minor <= minor:
            return True
        if kind == "compute" and (a_major, a_minor) <= (major, minor):
            return True
    return False


def check_torch(env: Environment) -> list[Check]:
    info = env.torch
    if info is None:
        return [Check("PyTorch", "skip", "not installed (bundles run without it; bench/profile need it for the source model)")]
    head = f"torch {info['version']}, CUDA build {info['cuda'] or 'none (CPU build)'}"
    if isinstance(env.gpus, str):
        return [Check("PyTorch", "ok", head)]
    if info["cuda"] is None:
        return [Check("PyTorch", "warn", f"{head}: cannot use the GPU", TORCH_INDEX.format(cuda="130"))]
    checks = []
    if env.driver_cuda and runtime.version_tuple(env.driver_cuda) < runtime.version_tuple(info["cuda"])[:2]:
        checks.append(Check("PyTorch", "fail", f"{head}, but the driver supports CUDA {env.driver_cuda} only "
                            "(\"CUDA driver version is insufficient for CUDA runtime version\")",
                            f"update the NVIDIA driver, or install torch for CUDA <= {env.driver_cuda}"))
    for name, cc in env.gpus:
        if not torch_runs_on(info["archs"], cc):
            checks.append(Check("PyTorch", "fail", f"{head} has kernels for {', '.join(info['archs'])}, none for "
                                f"{name} (sm_{cc.replace('.', '')}): its CUDA calls fail with \"no kernel image is "
                                "available for execution on the device\"",
                                "install a torch build whose arch list includes this GPU (newer CUDA wheels "
                                f"cover newer GPUs): {TORCH_INDEX.format(cuda='130')}"))
    return checks or [Check("PyTorch", "ok", f"{head}; kernels for {', '.join(info['archs'])}")]


def check_nvcc(env: Environment) -> list[Check]:
    if env.nvcc is None:
        return [Check("nvcc", "warn", "not found: deploykit's libraries build without CUDA kernels (CPU only)",
                      "install the CUDA toolkit (nvcc on PATH) and run deploykit build-plugins --force")]
    if env.driver_cuda and runtime.version_tuple(env.nvcc) > runtime.version_tuple(env.driver_cuda):
        return [Check("nvcc", "warn", f"nvcc {env.nvcc} is newer than the driver's CUDA {env.driver_cuda}: kernels "
                      "it builds may not load (\"the provided PTX was compiled with an unsupported toolchain\")",
                      f"update the NVIDIA driver, or use a CUDA toolkit <= {env.driver_cuda}")]
    return [Check("nvcc", "ok", f"CUDA toolkit {env.nvcc}")]


def check_onnxruntime(env: Environment) -> list[Check]:
    info = env.onnxruntime
    gpu = not isinstance(env.gpus, str)
    if info is None:
        return [Check("ONNX Runtime", "fail", "neither onnxruntime nor onnxruntime-gpu is installed",
                      wheels.fix({}, gpu))]
    installed = ", ".join(f"{name} {version}" for name, version in info["distributions"].items())
    if len(info["distributions"]) > 1:
        return [Check("ONNX Runtime", "fail", f"{installed} are both installed and overwrite each other's files "
                      "(one package, onnxruntime, from two wheels)", wheels.fix(info["distributions"], gpu))]
    if info["version"] is None:
        reinstall = " ".join(f"{name}=={version}" for name, version in info["distributions"].items())
        return [Check("ONNX Runtime", "fail", f"{installed} is installed but does not import: {info['error']}",
                      f"pip install --force-reinstall {reinstall}")]
    head = f"onnxruntime {info['version']}; providers {', '.join(info['providers'])}"
    checks = [Check("ONNX Runtime", "ok", head)]
    if runtime.version_tuple(info["version"]) < runtime.MIN_ORT_FOR_OP_LIBRARY:
        checks = [Check("ONNX Runtime", "warn", f"{head}: deploykit's op library needs >= 1.21 (bundles fall back "
                        "to their ONNX functions)", "pip install -U onnxruntime")]
    if not isinstance(env.gpus, str) and runtime.CUDA_EP not in info["providers"]:
        checks.append(Check("ONNX Runtime", "warn", f"no {runtime.CUDA_EP}: bundles run on the CPU here",
                            f"pip uninstall -y {wheels.CPU} && pip install '{wheels.GPU_EXTRA}'"))
    return checks


def check_tensorrt(env: Environment) -> list[Check]:
    if not env.tensorrt:
        return [Check("TensorRT", "skip", "neither TensorRT nor TensorRT-RTX is installed (engines cannot be built or run)",
                      "pip install tensorrt (GPU machines) or pip install 'deploykit[tensorrt-rtx]'")]
    checks = []
    for flavour, version in env.tensorrt.items():
        label = "TensorRT-RTX" if flavour == "tensorrt-rtx" else "TensorRT"
        check = Check(label, "ok", f"{label} {version}")
        if flavour == "tensorrt-rtx":
            check.detail += f"; runs on compute capability {', '.join(env.rtx_targets or ())}"
            unsupported = [f"{n} ({cc})" for n, cc in ([] if isinstance(env.gpus, str) else env.gpus)
                           if cc not in (env.rtx_targets or ())]
            if unsupported:
                check = Check(label, "warn", f"{label} {version} does not run on {', '.join(unsupported)} "
                              "(it refuses Hopper 9.0 and 10.x)", "pip install tensorrt (full TensorRT) for this GPU")
        checks.append(check)
    return checks


def check_cuda_python(env: Environment) -> list[Check]:
    if env.cuda_python:
        return [Check("cuda-python", "ok", f"cuda-bindings {env.cuda_python}: engines run without torch")]
    return [Check("cuda-python", "skip", "not installed: running engines needs torch for device memory",
                  "pip install cuda-python")]


def check_openvino(env: Environment) -> list[Check]:
    if "openvino" not in env.openvino:
        return [Check("OpenVINO", "skip", "not installed: convert --backend openvino is refused, and bundles' "
                      "OpenVINO models run in ONNX Runtime instead", f"pip install '{OPENVINO_EXTRA}'")]
    found = f"OpenVINO {env.openvino['openvino']}"
    if "nncf" in env.openvino:
        return [Check("OpenVINO", "ok", f"{found}, NNCF {env.openvino['nncf']}")]
    return [Check("OpenVINO", "warn", f"{found}: no NNCF, so no int8 models", f"pip install '{OPENVINO_EXTRA}'")]


def check_libraries(env: Environment) -> list[Check]:
    if not env.libraries:
        return [Check("deploykit libraries", "skip", "no build in the cache yet (deploykit convert builds them)")]
    return [Check("deploykit libraries", "ok" if why == "ok" else "fail", f"{name} loads" if why == "ok" else f"{name}: {why}",
                  "" if why == "ok" else "rebuild: deploykit build-plugins --force, then re-run deploykit convert")
            for name, why in env.libraries.items()]


def check_bundle(bundle: runtime.Bundle, env: Environment, trust_native: bool = False) -> list[Check]:
    checks = [_check_files(bundle), *check_native(env, trust_native)]
    passed = bundle.passed
    checks.append(Check("bundle validation", "ok" if passed else "fail",
                        "passed against PyTorch" if passed else "failed against PyTorch (see report.html)",
                        "" if passed else "fix the conversion; deploykit run --allow-failed runs it anyway"))
    recorded = bundle.recorded_version("onnxruntime-gpu", "onnxruntime")
    if env.onnxruntime and recorded and recorded != env.onnxruntime["version"]:
        checks.append(Check("bundle versions", "warn", f"validated with onnxruntime {recorded}, this machine has "
                            f"{env.onnxruntime['version']}: outputs may differ slightly",
                            f"pip install onnxruntime=={recorded}, or re-run deploykit convert here"))
    for entry in bundle.openvino:
        running = env.openvino.get("openvino")
        if running is None:
            checks.append(Check("bundle OpenVINO model", "warn", f"{entry['file']} is not used: OpenVINO is not "
                                "installed (ONNX Runtime runs the bundle)", f"pip install '{OPENVINO_EXTRA}'"))
        elif running != entry.get("openvino"):
            checks.append(Check("bundle OpenVINO model", "warn", f"{entry['file']} was validated with OpenVINO "
                                f"{entry.get('openvino')}, this machine has {running}: outputs may differ slightly",
                                f"pip install openvino=={entry.get('openvino')}, or re-run deploykit convert here"))
    for entry in bundle.engines:
        installed = (env.tensorrt.get(entry["flavour"]), env.rtx_targets if entry["flavour"] == "tensorrt-rtx" else None)
        problem = runtime.engine_problem(entry, installed, env.gpus)
        status = "ok" if not problem else "warn" if isinstance(env.gpus, str) else "fail"  # no GPU: ORT runs it
        checks.append(Check("bundle engine", status,
                            f"{entry['file']}: {problem}" if problem else f"{entry['file']} runs on {env.gpus[0][0]}",
                            _engine_fix(problem) if problem else ""))
    return checks


def check_native(env: Environment, trust_native: bool = False) -> list[Check]:
    """A line per native file of the bundle, with its provenance here (trust.native_files): one not
    built here is what a run quietly swaps or passes over, so doctor names it, what deploykit does
    instead and the consent that would load it."""
    return [_native_check(native, env, trust_native) for native in env.native]


def _native_check(native: trust.NativeFile, env: Environment, trust_native: bool) -> Check:
    head = f"{native.file} ({native.kind}): {native.provenance}"
    if native.known:
        return Check("bundle native code", "ok", head)
    if trust_native:
        return Check("bundle native code", "ok", f"{head}, trusted by consent (--trust-bundle): deploykit loads it")
    status, instead, ways_out = _instead_of(native, env)
    return Check("bundle native code", status, f"{head} (not made by this machine's deploykit): {instead}",
                 f"{ways_out}--trust-bundle loads it, if you trust whoever made the bundle")


def _instead_of(native: trust.NativeFile, env: Environment) -> tuple[str, str, str]:
    """(status, what deploykit does instead of loading a foreign native file, other ways out): fail
    only where nothing replaces it."""
    if native.kind == trust.ENGINE:
        return "warn", "deploykit runs the bundle on ONNX Runtime instead (--backend tensorrt refuses it)", ""
    if native.kind == trust.AOTI_PACKAGE:
        return "warn", "deploykit runs the bundle without it (--backend aoti refuses it; it is never replaced)", ""
    if native.file in env.substitutes:
        return "warn", f"deploykit uses this machine's build {env.substitutes[native.file]} instead", ""
    return ("fail", "nothing here replaces it, so deploykit refuses it (exit 2)",
            "deploykit build-plugins builds this machine's own (used instead); --no-op-library runs the ONNX "
            "function fallbacks; ")


def _engine_fix(problem: str) -> str:
    if "need an NVIDIA GPU" in problem:
        return "run it on a machine with a supported GPU; ONNX Runtime runs the bundle here"
    return problem.rsplit(": ", 1)[-1] if ": " in problem else problem


def _check_files(bundle: runtime.Bundle) -> Check:
    bad = [f"{name} ({problem})" for name, problem in bundle.file_problems().items()]
    if bad:
        return Check("bundle files", "fail", f"changed or missing since conversion: {', '.join(bad)}",
                     "restore the files or re-run deploykit convert")
    return Check("bundle files", "ok", f"{len(bundle.manifest.get('files', {}))} files match manifest.json")


CHECKS = (check_gpu, check_torch, check_nvcc, check_onnxruntime, check_tensorrt, check_cuda_python, check_openvino,
          check_libraries)


def diagnose(bundle_path: Path | None = None, env: Environment | None = None,
             trust_native: bool = False) -> tuple[list[Check], Environment]:
    """All checks for this machine (and a bundle); gathers the environment unless given."""
    bundle = runtime.open_bundle(bundle_path) if bundle_path is not None else None
    env = env or gather(bundle, trust_native)
    checks = [check for function in CHECKS for check in function(env)]
    if bundle is not None:
        checks += check_bundle(bundle, env, trust_native)
    return checks, env
