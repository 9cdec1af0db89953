"""Triton Inference Server's own programs, fetched once into deploykit's cache: ``tritonserver``
(HTTP, gRPC and metrics, with its python backend) for the tests that load our exports in a real
server, and ``perf_analyzer``, Triton's C++ load generator, for benchmarks/perf_analyzer.py.

Both come from PyPI wheels, downloaded with ``pip download --no-deps`` and unzipped, never
installed: ``nvidia-pytriton`` ships a whole tritonserver (its libraries in
``nvidia_pytriton.libs``, found by RPATH) but pins numpy<2, so it cannot be a dependency;
``tritonclient``'s wheel carries perf_analyzer. perf_analyzer asks for ``libb64.so.0d`` and
``libcudart.so.12`` by their plain names, which the pytriton wheel holds under hashed names:
links under the plain names, in a folder on its LD_LIBRARY_PATH, give it those (the CUDA runtime
is the one tritonserver itself runs with).

The unpacked tree lives in ``$DEPLOYKIT_CACHE/triton/<version>`` and is made under the cache's
file lock (native.build.fetch_once), so concurrent pytest-xdist workers fetch it once.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

from deploykit.errors import EnvironmentProblem
from deploykit.native import build

TRITON_VERSION = "2.51.0"
PYTRITON = "nvidia-pytriton==0.7.0"  # tritonserver 2.51.0
TRITONCLIENT = f"tritonclient=={TRITON_VERSION}"  # perf_analyzer 2.51.0
SERVER = "pytriton/tritonserver"
LIBS = "nvidia_pytriton.libs"
#: perf_analyzer's libraries under the names it asks for -> their file in the pytriton wheel
PERF_ANALYZER_LIBS = {"libb64.so.0d": "libb64-98cb6333.so.0d", "libcudart.so.12": "libcudart-09529672.so.12.6.77"}
HINT = "fetch them where PyPI is reachable and carry $DEPLOYKIT_CACHE over"


@dataclasses.dataclass(frozen=True)
class Program:
    """A command line to start and the environment it must run in (this process's, with changes)."""

    command: list[str]
    env: dict[str, str]


def tritonserver() -> Program:
    """``tritonserver --backend-directory DIR`` whose python backend runs this Python, so a model
    imports the deploykit (and torch, numpy) installed here. Its stub embeds libpython, found
    through LD_LIBRARY_PATH, and ignores PYTHONPATH: it takes the first ``python3`` on PATH as its
    interpreter, and that interpreter's site-packages (a venv's, .pth files included)."""
    root = fetch()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    backends = root / SERVER / f"backends-{version}"
    if not backends.is_dir():
        raise EnvironmentProblem(f"Triton {TRITON_VERSION}'s python backend has no stub for Python {version}: "
                                 f"run with Python {', '.join(_stub_versions(root))}")
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "python3").exists():
        raise EnvironmentProblem(f"{bin_dir} has no python3, which Triton's python stub looks up on PATH to find "
                                 "its Python: run from a virtual environment (it has bin/python3)")
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if not libdir or not soname or not (Path(libdir) / soname).is_file():
        raise EnvironmentProblem(f"this Python ({sys.executable}) has no shared libpython, which Triton's python "
                                 "stub embeds: use a Python built with --enable-shared")
    env = {**os.environ, "PATH": _prepend(bin_dir, os.environ.get("PATH")),
           "LD_LIBRARY_PATH": _prepend(Path(libdir), os.environ.get("LD_LIBRARY_PATH"))}
    return Program([str(root / SERVER / "bin" / "tritonserver"), f"--backend-directory={backends}"], env)


def perf_analyzer() -> Program:
    """``perf_analyzer`` with its two libraries on LD_LIBRARY_PATH."""
    root = fetch()
    env = {**os.environ, "LD_LIBRARY_PATH": _prepend(root / "lib", os.environ.get("LD_LIBRARY_PATH"))}
    return Program([str(root / "bin" / "perf_analyzer")], env)


def fetch(verbose: bool = False) -> Path:
    """The unpacked tree, fetched on first use; EnvironmentProblem (one line) when it cannot be."""
    target = build.cache_dir() / "triton" / TRITON_VERSION
    if problem := build.fetch_once(target, "bin/perf_analyzer", _unpack, verbose):
        raise EnvironmentProblem(f"cannot fetch Triton {TRITON_VERSION}: {problem}")
    return target


def _unpack(staging: Path, verbose: bool) -> None:
    """The server, its libraries and python backend, a backends folder per stub, perf_analyzer and
    its library links. perf_analyzer is unzipped last: its presence marks a complete tree."""
    with tempfile.TemporaryDirectory(prefix="deploykit-triton-") as work:
        pytriton = build.pip_download(PYTRITON, Path(work), HINT, verbose)
        client = build.pip_download(TRITONCLIENT, Path(work), HINT, verbose)
        _unzip(pytriton, (f"{SERVER}/", f"{LIBS}/"), staging)
        for version in _stub_versions(staging):
            _backends_folder(staging, version)
        (staging / "lib").mkdir()
        for name, bundled in PERF_ANALYZER_LIBS.items():
            if not (staging / LIBS / bundled).is_file():
                raise build.FetchFailed(f"{pytriton.name} has no {LIBS}/{bundled}", HINT)
            (staging / "lib" / name).symlink_to(Path("..", LIBS, bundled))
        _unzip(client, (f"tritonclient-{TRITON_VERSION}.data/data/bin/perf_analyzer",), staging, flatten_to="bin")
        if not (staging / "bin" / "perf_analyzer").is_file():
            raise build.FetchFailed(f"{client.name} has no perf_analyzer", HINT)
        (staging / "SOURCE").write_text(f"{pytriton.name}\n{client.name}\n")


def _backends_folder(root: Path, version: str) -> None:
    """``backends-X.Y/python``: the python backend and the stub for Python X.Y, where Triton looks
    for it (a sibling of ``backends``, so the libraries' RPATH $ORIGIN/../../../../nvidia_pytriton.libs holds)."""
    python = root / SERVER / f"backends-{version}" / "python"
    python.mkdir(parents=True)
    for item in (root / SERVER / "backends" / "python").iterdir():
        shutil.copy2(item, python / item.name)
    shutil.copy2(root / SERVER / "python_backend_stubs" / version / "triton_python_backend_stub", python)


def _stub_versions(root: Path) -> list[str]:
    stubs = root / SERVER / "python_backend_stubs"
    return sorted((p.name for p in stubs.iterdir() if (p / "triton_python_backend_stub").is_file()),
                  key=lambda v: tuple(map(int, v.split("."))))


def _unzip(wheel: Path, prefixes: tuple[str, ...], out: Path, flatten_to: str | None = None) -> None:
    """The members under ``prefixes`` (into ``out/flatten_to`` by file name, else at their paths),
    executables kept executable (zipfile drops the mode)."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if info.is_dir() or not info.filename.startswith(prefixes):
                continue
            target = out / flatten_to / Path(info.filename).name if flatten_to else out / info.filename
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, open(target, "wb") as sink:
                shutil.copyfileobj(source, sink)
            if (info.external_attr >> 16) & 0o111:
                target.chmod(0o755)


def _prepend(folder: Path, path: str | None) -> str:
    return os.pathsep.join(filter(None, [str(folder), path]))
