"""Whether an AOTInductor package can run here. A package is a compiled .so built against one
torch's C++ ABI and, for cuda, one GPU architecture (or, for cpu, one vector instruction set):
one pure rule, for ``load``, doctor, the AOTI runner and the tests.
"""

from __future__ import annotations

from typing import Mapping

from deploykit.bundle.read import version_tuple


def package_problem(entry: Mapping, torch_version: str, gpus, cpu_isas: list[str]) -> str | None:
    """Why a package cannot run with ``torch_version`` on ``gpus`` and ``cpu_isas`` (None: it can). Pure.

    ``gpus``: ((name, "major.minor"), ...) or the reason there is none; ``cpu_isas``: the vector
    ISAs inductor finds usable on this CPU (``"avx512"``...).
    """
    built = entry["torch"]
    if version_tuple(built)[:3] != version_tuple(torch_version)[:3]:
        return (f"{entry['file']} was compiled by torch {built} and this is torch {torch_version}; an AOTInductor "
                f"package runs only on the torch that compiled it: pip install torch=={built.split('+')[0]}, or "
                "convert with --backend aoti here")
    if entry["device"] == "cuda":
        if isinstance(gpus, str) or not gpus:
            return f"{entry['file']} is compiled for CUDA and {gpus or 'there is no GPU here'}"
        name, capability = gpus[0]
        if entry.get("cuda_arch") and capability != entry["cuda_arch"]:
            return (f"{entry['file']} was compiled for compute capability {entry['cuda_arch']} "
                    f"({entry.get('gpu') or 'another GPU'}) and this {name} is {capability}: convert with "
                    "--backend aoti on this GPU")
        return None
    isa = entry.get("cpu_isa")
    if isa and isa not in cpu_isas:
        usable = ", ".join(cpu_isas) or "none"
        return (f"{entry['file']} was compiled for the CPU vector instructions {isa} and this CPU offers {usable}: "
                "convert with --backend aoti on this machine")
    return None


def cuda_gpus(device_id: int = 0):
    """((name, "major.minor"),) of GPU ``device_id`` as torch sees it, or why there is none."""
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU (CUDA build: {torch.version.cuda})"
    if device_id >= torch.cuda.device_count():
        return f"there is no GPU cuda:{device_id} ({torch.cuda.device_count()} visible)"
    major, minor = torch.cuda.get_device_capability(device_id)
    return ((torch.cuda.get_device_name(device_id), f"{major}.{minor}"),)


def cpu_isas() -> list[str]:
    """The vector ISAs inductor can use on this CPU, best first (as recorded in ``cpu_isa``)."""
    from torch._inductor import cpu_vec_isa

    return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]


def package_problem_here(entry: Mapping, device_id: int = 0) -> str | None:
    """``package_problem`` against this torch, GPU ``device_id`` and CPU."""
    import torch

    gpus = cuda_gpus(device_id) if entry["device"] == "cuda" else ()
    return package_problem(entry, torch.__version__, gpus, cpu_isas() if entry["device"] == "cpu" else [])


class PackageChecks:
    """``package_problem_here`` on GPU ``device_id`` once per package file: choosing the entry, the
    loader and each package it loads (and tune's candidates) ask about the same packages in one load."""

    def __init__(self, device_id: int = 0):
        self.device_id, self._problems = device_id, {}

    def problem(self, entry: Mapping) -> str | None:
        if entry["file"] not in self._problems:
            self._problems[entry["file"]] = package_problem_here(entry, self.device_id)
        return self._problems[entry["file"]]
