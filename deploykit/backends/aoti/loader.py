"""Opening an AOTInductor package: torch loads its compiled .so into this process.

Only :mod:`deploykit.backends.aoti.bundle` (after ``deploykit.bundle.trust`` said yes) and the
conversion (packages it has just compiled) call this.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from deploykit.errors import EnvironmentProblem, error_summary


@dataclasses.dataclass
class Package:
    """A loaded package and its manifest entry; ``cuda_graph``: the runner replays it as CUDA graphs."""

    entry: dict
    model: object  # torch's AOTICompiledModel: called with the inputs in order, returns the outputs
    cuda_graph: bool = False

    @property
    def file(self) -> str:
        return self.entry["file"]

    @property
    def static(self) -> bool:
        return is_static(self.entry)

    def accepts(self, batch: int) -> bool:
        """Inside the batch range it was compiled for (a dynamic package's code assumes that range)."""
        return self.entry["batch"]["min"] <= batch <= self.entry["batch"]["max"]

    def describe(self) -> str:
        batch = self.entry["batch"]
        sizes = f"batch {batch['min']}" if self.static else f"batch {batch['min']}..{batch['max']}"
        return f"{self.file} ({sizes})"


def is_static(entry: dict) -> bool:
    """A static package was compiled for one batch size; a dynamic one for a range."""
    return entry["batch"]["min"] == entry["batch"]["max"]


def load_package(path: Path, entry: dict, device_id: int = 0, cuda_graph: bool = False) -> Package:
    """Load ``path`` for ``entry["device"]``. A package to be captured as CUDA graphs is loaded
    single-threaded: its run then has no event synchronisation, which capture does not allow."""
    import torch

    index = device_id if entry["device"] == "cuda" else -1
    try:
        model = torch._inductor.aoti_load_package(str(path), run_single_threaded=cuda_graph, device_index=index)
    except Exception as error:  # torch raises RuntimeError with the loader's message
        raise EnvironmentProblem(f"torch {torch.__version__} cannot load {entry['file']}: {error_summary(error)[:300]}; "
                                 "convert with --backend aoti on this machine") from error
    return Package(entry, model, cuda_graph)
