"""Build deploykit's native libraries (``csrc/`` with CMake) and find the ONNX Runtime op library.

Headers come from the environment (``ORT_ROOT``, ``TENSORRT_ROOT``, ``CUBLAS_ROOT``) or are
fetched once into the cache without installing anything: ONNX Runtime's from Debian's
``libonnxruntime-dev`` package, TensorRT's from the ``kernel-lens`` wheel, cuBLASLt's from the
installed ``nvidia-cublas`` wheel. Builds live in ``$DEPLOYKIT_CACHE/build/<key>`` (default
``~/.cache/deploykit``), keyed by a hash of the sources and options, so an unchanged tree is
reused at once; the three most recently used builds are kept. A cache prepared with ``fetch_headers()`` can be carried to an offline machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from deploykit.errors import BadInputError, EnvironmentProblem

DEFAULT_CUDA_ARCHITECTURES = "80;86;89;90;120"
BUILD_FORMAT = 1  # bump when the build recipe changes in a way the sources hash cannot see
MIN_CMAKE = (3, 24)
ORT_DEBIAN_SUITE = "trixie"
ORT_DEBIAN_PACKAGE = "libonnxruntime-dev"
KERNEL_LENS = "kernel-lens==2.0.1"  # ships TensorRT 10.14 headers in kernel_lens/include/tensorrt/
KERNEL_LENS_HEADERS = "kernel_lens/include/tensorrt/"
NLOHMANN_JSON = "nlohmann-json==3.12.0"  # ships nlohmann/json's headers in nlohmann_json/include/
NLOHMANN_JSON_HEADERS = "nlohmann_json/include/"
NETWORK_TIMEOUT_S = "30"
CUBLAS_INSTALL_HINT = "pip install nvidia-cublas, or set CUBLAS_ROOT"

SOURCE_ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = {
    "onnxruntime": "libdeploykit_ort.so",
    "tensorrt": "libdeploykit_trt.so",
    "kernels": "libdeploykit_kernels.so",
}
# Component named by each "deploykit: <what> disabled: <reason> (<install>)" line of csrc/.
CMAKE_COMPONENTS = {
    "CUDA kernels": "cuda",
    "ONNX Runtime op library": "onnxruntime",
    "TensorRT plugins": "tensorrt",
}
MANIFEST = "deploykit-build.json"
KEEP_BUILDS = 3  # builds the cache keeps: the newest and the last few used (other trees, options)


@dataclasses.dataclass(frozen=True)
class Disabled:
    """Why a component was not built, and what to install or set to get it."""

    reason: str
    install: str

    def __str__(self) -> str:
        return f"{self.reason} ({self.install})" if self.install else self.reason


@dataclasses.dataclass(frozen=True)
class NativeBuild:
    """The libraries one build produced; a component left out is listed in ``disabled``."""

    build_dir: Path
    ort_library: Path | None
    tensorrt_library: Path | None
    kernels_library: Path | None
    cuda: bool
    disabled: dict[str, Disabled]
    cached: bool
    seconds: float

    def summary(self) -> list[str]:
        """One line per component, for the CLI."""
        lines = [f"build: {self.build_dir} ({'cached' if self.cached else f'{self.seconds:.0f} s'})"]
        for name, path in (("onnxruntime", self.ort_library), ("tensorrt", self.tensorrt_library),
                           ("kernels", self.kernels_library)):
            lines.append(f"{name}: {path}" if path else f"{name}: disabled: {self.disabled.get(name)}")
        lines += [f"{name}: disabled: {why}" for name, why in self.disabled.items()
                  if name not in LIBRARIES]
        return lines


@dataclasses.dataclass(frozen=True)
class Headers:
    """Include directories found or fetched; a missing one has its reason in ``problems``."""

    onnxruntime: Path | None
    tensorrt: Path | None
    cublas: Path | None
    problems: dict[str, Disabled]


@dataclasses.dataclass(frozen=True)
class Toolchain:
    cmake: str
    cmake_version: str
    generator: str
    make_program: str
    cxx: str


# --------------------------------------------------------------------------- public entry points


def build_plugins(force: bool = False, cuda_architectures: str | list | None = None,
                  verbose: bool = False, before_building: Callable[[Path], None] | None = None) -> NativeBuild:
    """Configure and build ``csrc/`` once per source/option hash; reuse it afterwards.
    ``before_building(build_dir)`` runs only when CMake is about to start (minutes), so a caller can
    say why it waits.

    Raises EnvironmentProblem when no toolchain (CMake, a C/C++ compiler, ninja or make) is
    found or CMake cannot configure; components that cannot be built are reported, not raised.
    """
    toolchain = find_toolchain()
    headers = fetch_headers(verbose)
    archs = cuda_archs(cuda_architectures)
    key = build_key(toolchain, headers, archs)
    build_dir = cache_dir() / "build" / key
    with _locked(build_dir.with_suffix(".lock")):
        if force:
            shutil.rmtree(build_dir, ignore_errors=True)
        elif (cached := _read_manifest(build_dir, key)) is not None:
            os.utime(build_dir / MANIFEST)  # last used: what pruning keeps
            return cached
        if before_building is not None:
            before_building(build_dir)
        build = _build(build_dir, key, toolchain, headers, archs, verbose)
    prune_builds(KEEP_BUILDS)
    return build


def prune_builds(keep: int, root: Path | None = None) -> list[Path]:
    """Delete all but the ``keep`` most recently used builds under ``root`` (default: the op
    library's); one that another process holds (building or reading it) stays. Bundles carry
    copies of their libraries, so none breaks."""
    root = root or cache_dir() / "build"
    builds = sorted((d for d in root.iterdir() if d.is_dir()), key=_last_used, reverse=True) if root.is_dir() else []
    removed = []
    for old in builds[keep:]:
        lock = old.with_suffix(".lock")
        with open(lock, "w") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(old, ignore_errors=True)
            lock.unlink(missing_ok=True)
            removed.append(old)
    return removed


def _last_used(build_dir: Path) -> float:
    manifest = build_dir / MANIFEST
    return (manifest if manifest.is_file() else build_dir).stat().st_mtime


def find_ort_library(before_building: Callable[[Path], None] | None = None) -> Path:
    """Path of ``libdeploykit_ort.so``, built on first use (``before_building`` as :func:`build_plugins`
    takes it); EnvironmentProblem if it cannot be."""
    build = build_plugins(before_building=before_building)
    if build.ort_library is None:
        why = build.disabled.get("onnxruntime", Disabled("it was not built", ""))
        raise EnvironmentProblem(f"{LIBRARIES['onnxruntime']} is not available: {why}")
    return build.ort_library


def fetch_headers(verbose: bool = False) -> Headers:
    """Find or fetch every header set the build uses (also prepares a cache to carry offline)."""
    problems: dict[str, Disabled] = {}
    found = {}
    for name, finder in (("onnxruntime", ort_headers), ("tensorrt", tensorrt_headers),
                         ("cublas", cublas_headers)):
        path, problem = finder(verbose)
        found[name] = path
        if problem is not None:
            problems[name] = problem
    return Headers(found["onnxruntime"], found["tensorrt"], found["cublas"], problems)


def cache_dir() -> Path:
    """``$DEPLOYKIT_CACHE``, else ``~/.cache/deploykit``: headers and builds live here."""
    configured = os.environ.get("DEPLOYKIT_CACHE")
    return Path(configured).expanduser().resolve() if configured else Path.home() / ".cache" / "deploykit"


def cuda_archs(requested: str | list | None = None) -> str:
    """CMake's list form of the GPU architectures: argument, else $DEPLOYKIT_CUDA_ARCHS, else default."""
    value = requested if requested is not None else os.environ.get("DEPLOYKIT_CUDA_ARCHS")
    if value is None or value == "":
        value = DEFAULT_CUDA_ARCHITECTURES
    items = value if isinstance(value, (list, tuple)) else re.split(r"[;,\s]+", str(value))
    archs = [str(item).strip() for item in items if str(item).strip()]
    if not archs or not all(re.fullmatch(r"\d+[a-z]?(-real|-virtual)?", a) for a in archs):
        raise BadInputError(f"bad CUDA architectures {value!r}: use e.g. DEPLOYKIT_CUDA_ARCHS=90 or '80;90'")
    return ";".join(archs)


# --------------------------------------------------------------------------- toolchain


def find_toolchain() -> Toolchain:
    """CMake >= 3.24, C and C++ compilers and ninja (preferred) or make, or EnvironmentProblem."""
    cmake = _which("cmake")
    if cmake is None:
        raise EnvironmentProblem(
            "cmake not found: install CMake >= 3.24 (apt-get install cmake, or pip install cmake)")
    parsed = _cmake_version(cmake)
    version = ".".join(map(str, parsed))
    if parsed < MIN_CMAKE:
        raise EnvironmentProblem(f"cmake {version} is too old: install CMake >= 3.24 (pip install cmake)")
    cxx = os.environ.get("CXX") or _which("c++", "g++", "clang++")
    cc = os.environ.get("CC") or _which("cc", "gcc", "clang")
    if not cxx or not cc:
        raise EnvironmentProblem("no C/C++ compiler found: install gcc and g++ "
                                 "(apt-get install build-essential) or set CC and CXX")
    if ninja := _which("ninja"):
        return Toolchain(cmake, version, "Ninja", ninja, cxx)
    if make := _which("make", "gmake"):
        return Toolchain(cmake, version, "Unix Makefiles", make, cxx)
    raise EnvironmentProblem(
        "neither ninja nor make found: install ninja (apt-get install ninja-build, or pip install ninja)")


def _which(*names: str) -> str | None:
    """First of ``names`` on PATH or next to this Python (pip's cmake and ninja live there)."""
    for name in names:
        found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
        if found:
            return found
    return None


def _cmake_version(cmake: str) -> tuple[int, ...]:
    output = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"version (\d+)\.(\d+)", output)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


# --------------------------------------------------------------------------- headers


def ort_headers(verbose: bool = False) -> tuple[Path | None, Disabled | None]:
    """ONNX Runtime's C/C++ API headers: $ORT_ROOT, else Debian's package fetched into the cache."""
    return ORT_HEADERS.find(verbose)


def tensorrt_headers(verbose: bool = False) -> tuple[Path | None, Disabled | None]:
    """TensorRT headers: $TENSORRT_ROOT/include, else the kernel-lens wheel's, fetched into the cache."""
    return TENSORRT_HEADERS.find(verbose)


def json_headers(verbose: bool = False) -> tuple[Path | None, Disabled | None]:
    """nlohmann/json.hpp (the C++ runtime reads manifests with it): $NLOHMANN_JSON_ROOT/include,
    else the nlohmann-json wheel's, fetched into the cache."""
    return JSON_HEADERS.find(verbose)


def cublas_headers(verbose: bool = False) -> tuple[Path | None, Disabled | None]:
    """cublasLt.h: $CUBLAS_ROOT, else the nvidia-cublas wheel installed with torch."""
    roots = [Path(os.environ["CUBLAS_ROOT"])] if os.environ.get("CUBLAS_ROOT") else []
    candidates = [r / sub for r in roots for sub in ("include", ".")]
    candidates += [Path(p) / "nvidia" / sub / "include" for p in sys.path if p
                   for sub in ("cu13", "cublas")]
    for candidate in candidates:
        if (candidate / "cublasLt.h").is_file():
            return candidate.resolve(), None
    return None, Disabled("no cublasLt.h: the CUDA MatMulRelu uses its fallback kernel, not cuBLASLt",
                          CUBLAS_INSTALL_HINT)


@dataclasses.dataclass(frozen=True)
class HeaderSet:
    """Where one set of headers comes from: ``$<env>`` (an unpacked release), else fetched once
    into the cache's ``headers/<name>``."""

    name: str
    env: str
    #: the file that shows the set is there
    header: str
    #: folders under ``$<env>`` that may hold ``header``
    env_includes: tuple[str, ...]
    #: the folder of the fetched set that holds ``header``
    cached_include: str
    #: what ``$<env>`` should point at
    release: str
    #: fills a staging folder with the set, or raises FetchFailed
    fetch: Callable[[Path, bool], None]

    def find(self, verbose: bool = False) -> tuple[Path | None, Disabled | None]:
        """The include folder, or None and why it is missing."""
        if root := os.environ.get(self.env):
            for include in self.env_includes:
                if (Path(root) / include / self.header).is_file():
                    return Path(root) / include, None
            return None, Disabled(f"{self.env}={root} has no include/{self.header}",
                                  f"point {self.env} at an unpacked {self.release}")
        target = cache_dir() / "headers" / self.name
        problem = fetch_once(target, f"{self.cached_include}/{self.header}", self.fetch, verbose)
        return (None, problem) if problem else (target / self.cached_include, None)


def fetch_once(target: Path, marker: str, fetch, verbose: bool) -> Disabled | None:
    """Make sure ``target/marker`` exists, ``fetch(staging, verbose)`` filling the folder if not (it
    raises FetchFailed); None when it does, else why not. Concurrent processes fetch once."""
    if (target / marker).is_file():  # the common, offline case: no lock, no network
        return None
    return _fetch_locked(target, marker, fetch, verbose)


@functools.cache
def _fetch_locked(target: Path, marker: str, fetch, verbose: bool) -> Disabled | None:
    """Fetch into a staging dir and rename it into place, under a lock; tried once per process."""
    with _locked(target.with_suffix(".lock")):
        if (target / marker).is_file():  # another process fetched it meanwhile
            return None
        shutil.rmtree(target, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            fetch(staging, verbose)
            staging.replace(target)
            return None
        except FetchFailed as failure:
            return failure.disabled
        finally:
            shutil.rmtree(staging, ignore_errors=True)


class FetchFailed(Exception):
    """A download or unpack step that failed: why, and what to install or set instead."""

    def __init__(self, reason: str, install: str):
        super().__init__(reason)
        self.disabled = Disabled(reason, install)


ORT_INSTALL_HINT = "set ORT_ROOT to an unpacked ONNX Runtime release"


def _fetch_debian_ort(staging: Path, verbose: bool) -> None:
    """Download Debian trixie's libonnxruntime-dev with a private apt state and unpack its headers."""
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise FetchFailed("no ONNX Runtime headers, and apt-get/dpkg-deb are missing to fetch them", ORT_INSTALL_HINT)
    mirror = debian_mirror()
    if mirror is None:
        raise FetchFailed("no ONNX Runtime headers, and no Debian mirror in the apt sources", ORT_INSTALL_HINT)
    with tempfile.TemporaryDirectory(prefix="deploykit-apt-") as work:
        deb = _apt_download(Path(work), mirror, verbose)
        unpacked = Path(work) / "root"
        run_fetch(["dpkg-deb", "-x", str(deb), str(unpacked)], "dpkg-deb -x", ORT_INSTALL_HINT, verbose)
        headers = unpacked / "usr" / "include" / "onnxruntime"
        if not (headers / "onnxruntime_cxx_api.h").is_file():
            raise FetchFailed(f"{deb.name} has no onnxruntime_cxx_api.h", ORT_INSTALL_HINT)
        shutil.copytree(headers, staging / "include" / "onnxruntime")
    (staging / "SOURCE").write_text(f"{deb.name} from {mirror} {ORT_DEBIAN_SUITE}\n")


def _apt_download(work: Path, mirror: str, verbose: bool) -> Path:
    """``apt-get update`` + ``download`` against a one-line trixie source, touching no system state."""
    (work / "lists" / "partial").mkdir(parents=True)
    (work / "cache" / "archives" / "partial").mkdir(parents=True)
    (work / "sources.list").write_text(f"deb {mirror} {ORT_DEBIAN_SUITE} main\n")
    options = {
        "Dir::Etc::SourceList": work / "sources.list", "Dir::Etc::SourceParts": "/dev/null",
        "Dir::State::Lists": work / "lists", "Dir::Cache": work / "cache",
        "Acquire::Languages": "none", "Acquire::Retries": "1",
        "Acquire::http::Timeout": NETWORK_TIMEOUT_S, "Acquire::https::Timeout": NETWORK_TIMEOUT_S,
    }
    if os.geteuid() == 0:  # apt's _apt sandbox user cannot write into our private directories
        options["APT::Sandbox::User"] = "root"
    apt = ["apt-get", "-q"] + [arg for k, v in options.items() for arg in ("-o", f"{k}={v}")]
    # --error-on=any: an unreachable mirror fails here, not later as "Unable to locate package"
    run_fetch(apt + ["update", "--error-on=any"], f"apt-get update ({mirror} {ORT_DEBIAN_SUITE})",
               ORT_INSTALL_HINT, verbose)
    run_fetch(apt + ["download", ORT_DEBIAN_PACKAGE], f"apt-get download {ORT_DEBIAN_PACKAGE}",
               ORT_INSTALL_HINT, verbose, cwd=work)
    debs = sorted(work.glob(f"{ORT_DEBIAN_PACKAGE}_*.deb"))
    if not debs:
        raise FetchFailed(f"apt-get download left no {ORT_DEBIAN_PACKAGE} package", ORT_INSTALL_HINT)
    return debs[0]


def debian_mirror() -> str | None:
    """The Debian archive URI this machine's apt sources use (not the security archive)."""
    entries = _apt_source_entries()
    codename = _os_release().get("VERSION_CODENAME", "")
    usable = [(uri, suites) for kind, uri, suites, components in entries
              if kind == "deb" and "main" in components and "security" not in uri
              and not any(s.endswith("-security") for s in suites)]
    for uri, suites in usable:
        if codename and codename in suites:
            return uri.rstrip("/")
    debian = [uri for uri, _ in usable if uri.rstrip("/").endswith("/debian")]
    return debian[0].rstrip("/") if debian else None


def _apt_source_entries() -> list[tuple[str, str, list[str], list[str]]]:
    """(type, uri, suites, components) of every enabled source, one-line and deb822 files alike."""
    etc = Path("/etc/apt")
    files = [etc / "sources.list"] + sorted((etc / "sources.list.d").glob("*"))
    entries = []
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if path.suffix == ".sources":
            entries += _parse_deb822(text)
        elif path.name == "sources.list" or path.suffix == ".list":
            entries += _parse_one_line(text)
    return entries


def _parse_one_line(text: str) -> list[tuple[str, str, list[str], list[str]]]:
    entries = []
    for line in text.splitlines():
        line = re.sub(r"\[[^\]]*\]", " ", line.split("#", 1)[0]).split()
        if len(line) >= 3 and line[0] in ("deb", "deb-src"):
            entries.append((line[0], line[1], [line[2]], line[3:]))
    return entries


def _parse_deb822(text: str) -> list[tuple[str, str, list[str], list[str]]]:
    entries = []
    for paragraph in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in paragraph.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, value = line.split(":", 1)
            fields[key.strip().lower()] = value.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        for kind in fields.get("types", "").split():
            for uri in fields.get("uris", "").split():
                entries.append((kind, uri, fields.get("suites", "").split(), fields.get("components", "").split()))
    return entries


def _os_release() -> dict[str, str]:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return {}
    return {k: v.strip('"') for k, _, v in (line.partition("=") for line in text.splitlines()) if k}


TRT_INSTALL_HINT = "set TENSORRT_ROOT to an unpacked TensorRT 10 release"


def _fetch_kernel_lens_trt(staging: Path, verbose: bool) -> None:
    """Unzip the TensorRT headers of the kernel-lens wheel."""
    _fetch_wheel_headers(staging, KERNEL_LENS, KERNEL_LENS_HEADERS, "NvInferRuntime.h", TRT_INSTALL_HINT,
                         verbose, flatten=True)


JSON_INSTALL_HINT = "set NLOHMANN_JSON_ROOT to an unpacked nlohmann/json release"


def _fetch_nlohmann_json(staging: Path, verbose: bool) -> None:
    """Unzip the headers of the nlohmann-json wheel, keeping their nlohmann/ folders."""
    _fetch_wheel_headers(staging, NLOHMANN_JSON, NLOHMANN_JSON_HEADERS, "nlohmann/json.hpp", JSON_INSTALL_HINT,
                         verbose, flatten=False)


def _fetch_wheel_headers(staging: Path, requirement: str, prefix: str, marker: str, hint: str, verbose: bool,
                         flatten: bool) -> None:
    """Download a wheel (no dependencies, not installed) and unzip its headers under ``prefix`` into
    ``staging/include`` (one flat folder, or the folders below ``prefix``)."""
    with tempfile.TemporaryDirectory(prefix="deploykit-pip-") as work:
        path = pip_download(requirement, Path(work), hint, verbose)
        with zipfile.ZipFile(path) as wheel:
            members = [m for m in wheel.namelist() if m.startswith(prefix) and m.endswith((".h", ".hpp"))]
            if not any(m.endswith("/" + marker) for m in members):
                raise FetchFailed(f"{path.name} has no {marker}", hint)
            for member in members:
                target = staging / "include" / (Path(member).name if flatten else member[len(prefix):])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(wheel.read(member))
        (staging / "SOURCE").write_text(f"{path.name}: {prefix}\n")


def pip_download(requirement: str, work: Path, hint: str, verbose: bool) -> Path:
    """One wheel downloaded into ``work``, without its dependencies and not installed (what we unzip
    needs none of them, and installing could change this environment's packages)."""
    run_fetch([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--timeout", NETWORK_TIMEOUT_S, "--retries", "1",
               "-d", str(work), requirement],
              f"pip download {requirement}", hint, verbose)
    name = re.split(r"[=<>!~ ]", requirement, maxsplit=1)[0].replace("-", "_").lower()
    wheels = sorted(w for w in work.glob("*.whl") if w.name.lower().startswith(name + "-"))
    if not wheels:
        raise FetchFailed(f"pip download {requirement} left no wheel", hint)
    return wheels[0]


def run_fetch(command: list[str], what: str, hint: str, verbose: bool, cwd: Path | None = None) -> None:
    """Run a download step; its failure becomes a FetchFailed naming the step and its last error."""
    hint = f"check network access to the package mirrors, or {hint}"
    try:
        result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise FetchFailed(f"{what} failed: {error}", hint) from error
    if verbose:
        sys.stderr.write(result.stdout + result.stderr)
    if result.returncode != 0:
        raise FetchFailed(f"{what} failed: {_last_error(result.stdout + result.stderr)}", hint)


ORT_HEADERS = HeaderSet("onnxruntime", "ORT_ROOT", "onnxruntime_cxx_api.h", ("include", "include/onnxruntime"),
                        "include/onnxruntime", "ONNX Runtime release", _fetch_debian_ort)
TENSORRT_HEADERS = HeaderSet("tensorrt", "TENSORRT_ROOT", "NvInferRuntime.h", ("include",), "include",
                             "TensorRT 10 release", _fetch_kernel_lens_trt)
JSON_HEADERS = HeaderSet("nlohmann_json", "NLOHMANN_JSON_ROOT", "nlohmann/json.hpp", ("include",), "include",
                         "nlohmann/json release", _fetch_nlohmann_json)


# --------------------------------------------------------------------------- build


def build_key(toolchain: Toolchain, headers: Headers, archs: str) -> str:
    """Hash of everything that changes the build: sources, headers, toolchain and options."""
    digest = hashlib.sha256()
    for part in (BUILD_FORMAT, archs, toolchain.generator, toolchain.cmake_version, toolchain.cxx,
                 os.environ.get("CC", ""), os.environ.get("CUDACXX", ""), _which("nvcc") or "",
                 platform.machine()):
        digest.update(f"{part}\0".encode())
    for name, path in (("ort", headers.onnxruntime and headers.onnxruntime / "onnxruntime_c_api.h"),
                       ("trt", headers.tensorrt and headers.tensorrt / "NvInferVersion.h"),
                       ("cublas", headers.cublas and headers.cublas / "cublasLt.h")):
        digest.update(name.encode() + (path.read_bytes() if path and path.is_file() else b"-"))
    for path in _source_files():
        digest.update(str(path.relative_to(SOURCE_ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _source_files() -> list[Path]:
    """The files of the CMake tree under csrc/ and plugins/; EnvironmentProblem outside a source checkout."""
    _require_sources()
    files = [p for d in ("csrc", "plugins") for p in (SOURCE_ROOT / d).rglob("*") if p.is_file()]
    # csrc/runtime (the C++ bundle runner) and the benchmarks are separate projects: not this build.
    separate = (SOURCE_ROOT / "csrc" / "runtime", SOURCE_ROOT / "csrc" / "kernels" / "bench")
    return sorted(p for p in files if not any(part.startswith(".") or part == "__pycache__"
                                              for part in p.relative_to(SOURCE_ROOT).parts)
                  and not any(p.is_relative_to(folder) for folder in separate))


def _require_sources() -> None:
    if not (SOURCE_ROOT / "csrc" / "CMakeLists.txt").is_file():
        raise EnvironmentProblem(f"deploykit's native sources are missing ({SOURCE_ROOT / 'csrc'}): "
                                 "build the plugins from a source checkout of deploykit")


def build_target(build_dir: Path, target: str, headers: Headers, archs: str, jobs: int) -> None:
    """Configure ``csrc/`` into ``build_dir`` as :func:`build_plugins` does and build one CMake
    target, outside the cache (``kernels.build_library``); RuntimeError with CMake's output if a step fails."""
    _require_sources()
    toolchain = find_toolchain()
    log = _new_log(build_dir)
    for command in (configure_command(build_dir, toolchain, headers, archs),
                    compile_command(build_dir, toolchain, target, jobs)):
        step = _run_step(command, log, verbose=False)
        if step.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed:\n{step.stdout}")


def _build(build_dir: Path, key: str, toolchain: Toolchain, headers: Headers, archs: str,
           verbose: bool) -> NativeBuild:
    """Configure, compile (keeping going past a failing component), record and return the result."""
    start = time.monotonic()
    log = _new_log(build_dir)
    configure = _run_step(configure_command(build_dir, toolchain, headers, archs), log, verbose)
    if configure.returncode != 0:
        raise EnvironmentProblem(f"cmake could not configure deploykit's native code: "
                                 f"{_last_error(configure.stdout)} (log: {log})")
    compiled = _run_step(compile_command(build_dir, toolchain), log, verbose)
    disabled = {**_disabled_from_cmake(configure.stdout), **_header_problems(headers)}
    libraries = built_libraries(build_dir)
    for name in LIBRARIES:
        if name not in libraries and name not in disabled:
            disabled[name] = Disabled(f"compilation failed: {_last_error(compiled.stdout)}", f"see {log}")
    result = NativeBuild(build_dir, libraries.get("onnxruntime"), libraries.get("tensorrt"),
                         libraries.get("kernels"), "cuda" not in disabled, disabled, False,
                         time.monotonic() - start)
    if compiled.returncode == 0:
        _write_manifest(result, key)
    return result


def _new_log(build_dir: Path) -> Path:
    """``build_dir/build.log``, empty: each CMake step appends to it."""
    build_dir.mkdir(parents=True, exist_ok=True)
    log = build_dir / "build.log"
    log.write_text("")
    return log


def configure_command(build_dir: Path, toolchain: Toolchain, headers: Headers, archs: str) -> list[str]:
    """``cmake`` configuring ``csrc/``: the one place the cache variables (csrc/CMakeLists.txt) are set."""
    defines = {
        "CMAKE_BUILD_TYPE": "Release",
        "CMAKE_MAKE_PROGRAM": toolchain.make_program,
        "DK_CUDA_ARCHITECTURES": archs,
        "ORT_INCLUDE_DIR": headers.onnxruntime or "",
        "TENSORRT_INCLUDE_DIR": headers.tensorrt or "",
        "CUBLAS_INCLUDE_DIR": headers.cublas or "",
    }
    return [toolchain.cmake, "-S", str(SOURCE_ROOT / "csrc"), "-B", str(build_dir), "-G", toolchain.generator,
            *(f"-D{name}={value}" for name, value in defines.items())]


def compile_command(build_dir: Path, toolchain: Toolchain, target: str | None = None,
                    jobs: int | None = None) -> list[str]:
    """``cmake --build``: one target, or everything, keeping going past a failing component."""
    command = [toolchain.cmake, "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 1)]
    if target is not None:
        return [*command, "--target", target]
    keep_going = ["-k", "0"] if toolchain.generator == "Ninja" else ["-k"]
    return [*command, "--", *keep_going]


def _run_step(command: list[str], log: Path, verbose: bool) -> subprocess.CompletedProcess:
    """Run one CMake step, appending its output to ``log`` (and streaming it when verbose)."""
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as error:
        raise EnvironmentProblem(f"cannot run {command[0]}: {error}") from error
    lines = []
    with log.open("a") as out:
        out.write(f"$ {shlex.join(command)}\n")
        for line in process.stdout:
            lines.append(line)
            out.write(line)
            if verbose:
                sys.stderr.write(line)
    return subprocess.CompletedProcess(command, process.wait(), "".join(lines))


def _disabled_from_cmake(output: str) -> dict[str, Disabled]:
    """Components csrc/CMakeLists.txt switched off, from its 'deploykit: X disabled: why (fix)' lines."""
    disabled = {}
    for match in re.finditer(r"deploykit: (.+?) disabled: (.+?)(?: \(([^()]*)\))?$", output, re.MULTILINE):
        name = CMAKE_COMPONENTS.get(match.group(1), match.group(1).lower())
        disabled[name] = Disabled(match.group(2), match.group(3) or "")
    if "deploykit: no cublasLt.h" in output:
        disabled["cublaslt"] = Disabled("no cublasLt.h: the CUDA MatMulRelu uses its fallback kernel",
                                        CUBLAS_INSTALL_HINT)
    return disabled


def _header_problems(headers: Headers) -> dict[str, Disabled]:
    """Our own reasons for missing ONNX Runtime / TensorRT headers (more precise than CMake's)."""
    return {name: problem for name, problem in headers.problems.items() if name in ("onnxruntime", "tensorrt")}


def built_libraries(build_dir: Path) -> dict[str, Path]:
    """The libraries of LIBRARIES a build produced, by name."""
    found = {}
    for name, filename in LIBRARIES.items():
        matches = sorted(p for p in build_dir.rglob(filename) if "CMakeFiles" not in p.parts)
        if matches:
            found[name] = matches[0]
    return found


def _last_error(output: str) -> str:
    """The line of a tool's output most likely to say what went wrong."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for pattern in (r"error:", r"\berror\b|^E:|FAILED"):
        errors = [line for line in lines if re.search(pattern, line, re.IGNORECASE)]
        if errors:
            return errors[0][:300]
    return lines[-1][:300] if lines else "no output"


# --------------------------------------------------------------------------- manifest and locking


def _write_manifest(build: NativeBuild, key: str) -> None:
    relative = {name: str(path.relative_to(build.build_dir)) for name, path in
                (("onnxruntime", build.ort_library), ("tensorrt", build.tensorrt_library),
                 ("kernels", build.kernels_library)) if path}
    data = {"key": key, "libraries": relative, "cuda": build.cuda, "seconds": build.seconds,
            "disabled": {name: [d.reason, d.install] for name, d in build.disabled.items()}}
    (build.build_dir / MANIFEST).write_text(json.dumps(data, indent=1))


def _read_manifest(build_dir: Path, key: str) -> NativeBuild | None:
    """The recorded build if it is complete and its libraries still exist."""
    try:
        data = json.loads((build_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    libraries = {name: build_dir / rel for name, rel in data.get("libraries", {}).items()}
    if data.get("key") != key or not all(path.is_file() for path in libraries.values()):
        return None
    disabled = {name: Disabled(*value) for name, value in data.get("disabled", {}).items()}
    return NativeBuild(build_dir, libraries.get("onnxruntime"), libraries.get("tensorrt"),
                       libraries.get("kernels"), bool(data.get("cuda")), disabled, True,
                       float(data.get("seconds", 0.0)))


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive file lock, so concurrent processes (pytest-xdist, two CLIs) build once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
