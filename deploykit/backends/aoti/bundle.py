"""A bundle's AOTInductor packages as one runner: each file verified against the manifest and
loaded only as ``deploykit.bundle.trust`` allows (a package is native code), those that cannot
run here left out with a note.
"""

from __future__ import annotations

from deploykit.backends.aoti.compat import PackageChecks
from deploykit.backends.aoti.loader import is_static, load_package
from deploykit.backends.aoti.runner import AotiRunner
from deploykit.bundle import trust
from deploykit.bundle.read import Bundle
from deploykit.errors import BadInputError, EnvironmentProblem

#: Which packages a runner holds: ``both`` routes each batch to its static package, else the dynamic one.
PACKAGE_CHOICES = ("both", "static", "dynamic")


def runnable_entry(bundle: Bundle, device: str, device_id: int = 0, checks: PackageChecks | None = None) -> dict:
    """The first of the bundle's packages for ``device`` ("cpu", "cuda"; "auto": cuda, else cpu) that
    can run on GPU ``device_id`` here (``checks``: what this load found so far); a clear error
    naming why none can."""
    if not bundle.aoti:
        raise BadInputError(f"{bundle.path} has no AOTInductor package: convert with --backend aoti")
    checks = checks or PackageChecks(device_id)
    problems = []
    for kind in ("cuda", "cpu") if device == "auto" else (device,):
        for entry in (e for e in bundle.aoti if e["device"] == kind):
            problem = checks.problem(entry)
            if problem is None:
                return entry
            problems.append(problem)
    if not problems:
        compiled = ", ".join(sorted({e["device"] for e in bundle.aoti}))
        where = "on a GPU machine" if device == "cuda" else "where torch sees no GPU (CUDA_VISIBLE_DEVICES=)"
        raise BadInputError(f"{bundle.path} has AOTInductor packages for {compiled} only, not {device}: use "
                            f"device='{compiled.split(', ')[0]}', or convert with --backend aoti {where}")
    raise EnvironmentProblem(f"cannot run {bundle.path.name}'s AOTInductor packages here: {problems[0]}")


def load_aoti(bundle: Bundle, entry: dict | None = None, device_id: int = 0, *, verify: bool = True,
              trust_native: bool = False, cuda_graph: bool | None = None, notes: list[str] | None = None,
              allow_unvalidated: bool = False, packages: str = "both", device: str = "auto",
              checks: PackageChecks | None = None) -> AotiRunner:
    """The bundle's packages of ``entry``'s device (default: the first for ``device`` that runs here,
    cuda first) on ``device_id``, as one runner. ``cuda_graph`` (None: each package's manifest value)
    replays cuda packages as CUDA graphs; ``packages`` keeps the static or dynamic ones only (tune
    compares them); ``checks``: what the caller found of the packages in this load."""
    if packages not in PACKAGE_CHOICES:
        raise BadInputError(f"packages={packages!r}: use one of {', '.join(PACKAGE_CHOICES)}")
    checks = checks or PackageChecks(device_id)
    entry = entry or runnable_entry(bundle, device, device_id, checks)
    problem = checks.problem(entry)
    if problem:
        raise EnvironmentProblem(f"cannot run {entry['file']} here: {problem}")
    notes, device = list(notes or []), entry["device"]
    chosen = packages_of(bundle, device, packages)
    if not chosen:
        raise BadInputError(f"{bundle.path} has no {packages} AOTInductor package for {device}: use packages='both'")
    loaded = []
    for candidate in chosen:
        problem = checks.problem(candidate)
        if problem:
            notes.append(f"{candidate['file']} left out: {problem}")
            continue
        path = trust.aoti_package(bundle, candidate, verify, trust_native)
        graph = device == "cuda" and (candidate.get("cuda_graph", False) if cuda_graph is None else cuda_graph)
        loaded.append(load_package(path, candidate, device_id, graph))
    runner = AotiRunner(loaded, device, device_id, inputs=bundle.inputs, outputs=bundle.outputs, notes=notes,
                        bundle=bundle, allow_unvalidated=allow_unvalidated)
    for package in loaded:
        if not package.entry.get("validated"):
            runner.warn(f"{package.file} was not validated against PyTorch at conversion time")
    return runner


def packages_of(bundle: Bundle, device: str, packages: str = "both") -> list[dict]:
    """The bundle's package entries for ``device``: all, or the static or the dynamic ones only."""
    return [e for e in bundle.aoti
            if e["device"] == device and (packages == "both" or (packages == "static") == is_static(e))]
