"""TensorRT and TensorRT-RTX behind one shim: which Python module is here, its logger, the
local GPUs and the compute capabilities RTX knows.

The two Python APIs share most of their surface:

- ``tensorrt`` (TensorRT >= 10, ``pip install tensorrt``): builds for the GPU it runs on, so it
  needs one. A plugin library travels inside the engine only in version-compatible engines, so
  ``VERSION_COMPATIBLE`` is set when one is given (and the runtime must allow host code).
- TensorRT-RTX (``tensorrt_rtx``, or ``tensorrt_rtx_bindings`` when only the
  ``tensorrt-rtx-cu13-libs`` + ``-bindings`` wheels are installed): builds ahead of time, also
  on a machine without a GPU, for the compute capabilities it is told (``ComputeCapability``:
  Turing, Ampere, Ada, Blackwell RTX; not Hopper 9.0 nor 10.x), and compiles kernels when the
  engine first runs (kept across runs by a runtime cache, not a timing cache). It always embeds
  ``plugins_to_serialize``.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from deploykit.errors import EnvironmentProblem

INSTALL_HINT = (
    "pip install tensorrt (TensorRT >= 10, needs an NVIDIA GPU) or "
    "pip install tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings (TensorRT-RTX, builds without a GPU)"
)


@dataclass(frozen=True)
class Flavour:
    """An imported TensorRT Python module and what kind it is."""

    module: object
    name: str  # "tensorrt" | "tensorrt-rtx"
    version: str

    @property
    def is_rtx(self) -> bool:
        return self.name == "tensorrt-rtx"

    @property
    def label(self) -> str:
        return f"{'TensorRT-RTX' if self.is_rtx else 'TensorRT'} {self.version}"


_CANDIDATES = (("tensorrt", "tensorrt"), ("tensorrt_rtx", "tensorrt-rtx"), ("tensorrt_rtx_bindings", "tensorrt-rtx"))


@lru_cache(maxsize=None)
def load_tensorrt(flavour: str | None = None) -> Flavour:
    """The first usable module: plain TensorRT first (users' GPU machines), then TensorRT-RTX."""
    problems = []
    for module_name, name in _CANDIDATES:
        if flavour not in (None, name) or importlib.util.find_spec(module_name) is None:
            continue
        try:
            module = importlib.import_module(module_name)
            version = str(module.__version__)
            module.Builder  # the PyPI stubs of TensorRT import but have no API
        except Exception as error:  # noqa: BLE001 - broken installs raise anything
            problems.append(f"{module_name}: {str(error).splitlines()[0] if str(error) else type(error).__name__}")
            continue
        if name == "tensorrt" and int(version.split(".")[0]) < 10:
            problems.append(f"tensorrt {version} is older than 10")
            continue
        return Flavour(module, name, version)
    found = f" ({'; '.join(problems)})" if problems else ""
    wanted = f"{flavour} " if flavour else ""
    raise EnvironmentProblem(f"no usable {wanted}TensorRT for Python{found}: {INSTALL_HINT}")


def installed_tensorrt(flavour: str) -> tuple[str | None, tuple[str, ...] | None]:
    """(version, RTX's supported compute capabilities or None) of an installed flavour; (None, None) if absent."""
    try:
        module = load_tensorrt(flavour)
    except EnvironmentProblem:
        return None, None
    return module.version, rtx_targets(module) if module.is_rtx else None


def ensure_rtx_library_link() -> Path | None:
    """Create ``libtensorrt_rtx.so`` beside ``libtensorrt_rtx.so.1`` in the RTX libs wheel.

    The wheel ships only the versioned name, but RTX's ONNX parser dlopens the unversioned one
    when it meets a plugin node, and aborts the process when that fails.
    """
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        return None  # not the wheel (a tarball or system install has its own links)
    directory = Path(next(iter(spec.submodule_search_locations)))
    link, target = directory / "libtensorrt_rtx.so", directory / "libtensorrt_rtx.so.1"
    if not target.exists() or link.exists():
        return link if link.exists() else None
    try:
        if link.is_symlink():  # dangling
            link.unlink()
        link.symlink_to(target.name)
    except FileExistsError:
        pass
    except OSError as error:
        raise EnvironmentProblem(
            f"TensorRT-RTX's parser needs {link} to load plugins and it cannot be created "
            f"({error.strerror}): run `ln -s {target.name} {link}` as the owner of that folder"
        ) from error
    return link


@lru_cache(maxsize=None)
def logger(flavour: Flavour):
    """One logger per module (TensorRT warns when builder and runtime get different ones);
    ``take()`` returns and clears (errors, warnings)."""
    trt = flavour.module

    class CollectingLogger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.messages: list[tuple[int, str]] = []

        def log(self, severity, message):
            if int(severity) <= int(trt.ILogger.Severity.WARNING):
                self.messages.append((int(severity), message))

        def take(self) -> tuple[list[str], list[str]]:
            errors = [m for s, m in self.messages if s <= int(trt.ILogger.Severity.ERROR)]
            warnings = [m for s, m in self.messages if s > int(trt.ILogger.Severity.ERROR)]
            self.messages.clear()
            return errors, warnings

    return CollectingLogger()


def local_gpus() -> tuple[tuple[str, str], ...] | str:
    """(name, "major.minor") of each visible GPU, from the driver; or why there are none."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver here (libcuda.so.1 not found)"
    if cuda.cuInit(0) != 0:
        return "the NVIDIA driver sees no usable GPU (cuInit failed)"
    count = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(count))
    gpus = []
    for ordinal in range(count.value):
        device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        name = ctypes.create_string_buffer(256)
        cuda.cuDeviceGet(ctypes.byref(device), ordinal)
        cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # COMPUTE_CAPABILITY_MAJOR
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)  # COMPUTE_CAPABILITY_MINOR
        cuda.cuDeviceGetName(name, 256, device)
        gpus.append((name.value.decode(), f"{major.value}.{minor.value}"))
    return tuple(gpus) if gpus else "the NVIDIA driver sees no GPU"


def rtx_targets(flavour: Flavour) -> tuple[str, ...]:
    """Compute capabilities this TensorRT-RTX can build for, e.g. ("7.5", ..., "12.0")."""
    names = [n for n in flavour.module.ComputeCapability.__members__ if n.startswith("SM")]
    return tuple(f"{n[2:-1]}.{n[-1]}" for n in names)
