"""The runner ``deploykit.load(backend="auto")`` returns for a bundle tuned on a machine like this one.

Each call goes by its batch size to the choice recorded for it: a tuned batch size exactly; any
other size to the choice of the nearest tuned size above it, else the nearest below (the one
above was timed on more work than this call has, so its backend is not one that only wins on
small batches), passing over a choice that does not take that size (a static AOTI package). All
sub-runners are opened at load, one per distinct choice. A choice that cannot run here (a torch
other than the package's, an engine this GPU cannot run) gives way to ONNX Runtime with a note.
Sizes no choice takes go to ONNX Runtime; where it cannot run here (onnxruntime without the CUDA
provider beside AOTInductor packages), those sizes are refused with the reason and the rest run.
"""

from __future__ import annotations

import json

from deploykit.backends.aoti.compat import PackageChecks
from deploykit.backends.base.feeds import given_batch
from deploykit.backends.base.runner import Runner
from deploykit.backends.openvino import loader as openvino
from deploykit.bundle.read import Bundle
from deploykit.errors import BadInputError, EnvironmentProblem
from deploykit.tuning import record
from deploykit.tuning.candidates import accepted_batches, choice_problem, find_candidates, open_runner, takes

#: ONNX Runtime options that tune its routes only: given, a tuned route on another backend still runs
#: (serve passes ``spin`` on the CPU whichever backend runs).
ORT_HINTS = ("spin",)


class Route:
    """A tuned batch size, the runner of its choice, and the sizes that runner takes (None: the bundle's)."""

    def __init__(self, batch: int, runner: Runner, accepts: list[tuple[int, int]] | None, label: str):
        self.batch, self.runner, self.accepts, self.label = batch, runner, accepts, label

    def takes(self, batch: int) -> bool:
        return takes(self.accepts, batch)


class TunedRunner(Runner):
    """Routes each call to the runner chosen for its batch size (see the module's docstring)."""

    backend = "tuned"

    def __init__(self, bundle: Bundle, device: str, routes: list[Route], fallback: Runner | None, notes: list[str],
                 no_fallback: str | None = None):
        first = routes[0].runner
        super().__init__(device, first.inputs, first.outputs, notes=notes, bundle=bundle, name=f"tuned-{device}")
        self.routes = sorted(routes, key=lambda route: route.batch)
        self.fallback, self.no_fallback = fallback, no_fallback
        for runner in self.runners():
            self.warnings += [note for note in runner.warnings if note not in self.warnings]

    def runners(self) -> list[Runner]:
        """Each distinct sub-runner once."""
        found = [route.runner for route in self.routes] + ([self.fallback] if self.fallback else [])
        return list({id(runner): runner for runner in found}.values())

    def runner_for(self, batch: int) -> Runner:
        exact = [route for route in self.routes if route.batch == batch and route.takes(batch)]
        above = [route for route in self.routes if route.batch > batch and route.takes(batch)]
        below = [route for route in reversed(self.routes) if route.batch < batch and route.takes(batch)]
        chosen = (exact or above or below or [None])[0]
        if chosen is not None:
            return chosen.runner
        if self.fallback is None:
            raise BadInputError(f"batch {batch}: {self.no_fallback}")
        return self.fallback

    def run(self, feeds=None, /, **named) -> dict:
        """The call, on the runner of its batch, which checks the feeds (an input missing: any runner
        says so)."""
        batch = given_batch(feeds, named, self.inputs)
        runner = self.runner_for(batch) if batch is not None else self.routes[0].runner
        return runner.run(feeds, **named)

    def describe(self) -> dict:
        return {**super().describe(), "routes": {route.batch: route.label for route in self.routes}}

    def close(self) -> None:
        for runner in self.runners():
            runner.close()


def tuning_problem(tuning: dict, device: str, device_id: int = 0) -> str | None:
    """Why a bundle's tuning table cannot route its runs on this device (None: it can)."""
    problem = record.mismatch(tuning, record.machine(device, device_id))
    if problem is None and not tuning.get("choices"):
        problem = "no candidate passed when it was tuned"
    return problem


def load_tuned(bundle: Bundle, device: str, device_id: int, notes: list[str], *, trust_native: bool = False,
               verify: bool = True, allow_unvalidated: bool = False, op_library: bool = True,
               **ort_options) -> TunedRunner | None:
    """The tuned runner, or None (with the reason in ``notes``) where the table is not for this machine."""
    tuning = bundle.manifest["tuning"]
    problem = tuning_problem(tuning, device, device_id)
    if problem:
        notes.append(f"tuning not used: {problem}")
        return None
    opened: dict[str, Runner] = {}
    checks = PackageChecks(device_id)  # each AOTInductor package checked once, by the candidates and loaders

    def runner(backend: str, options: dict) -> Runner:
        key = json.dumps([backend, options], sort_keys=True)
        if key not in opened:
            opened[key] = open_runner(bundle, backend, options, device, device_id, trust_native=trust_native,
                                      notes=list(notes), verify=verify, allow_unvalidated=allow_unvalidated,
                                      checks=checks,
                                      **_options_for(backend, ort_options, op_library))
        return opened[key]

    routes, here = [], find_candidates(bundle, device, trust_native, device_id, checks,
                                       convolutions=tuned_convolutions(tuning))
    for choice in tuning["choices"]:
        backend, options = choice["backend"], choice["options"]
        problem = choice_problem(here, backend, options)
        taken = _options_for(backend, ort_options, op_library)
        forcing = [name for name in ort_options if name not in taken and name not in ORT_HINTS]
        if problem is None and forcing and backend != "onnxruntime":
            problem = f"{', '.join(forcing)} apply to ONNX Runtime only"
        if problem:
            notes.append(f"batch {choice['batch']}: the tuned {backend} does not run here ({problem}): "
                         "ONNX Runtime instead")
            backend, options = "onnxruntime", {}
        label = f"{backend} {json.dumps(options, sort_keys=True)}" if options else backend
        routes.append(Route(choice["batch"], runner(backend, options), accepted_batches(here, backend, options),
                            label))
    fallback, no_fallback = None, None
    if any(route.accepts for route in routes):
        try:
            fallback = runner("onnxruntime", {})
        except EnvironmentProblem as problem:
            sizes = _sizes(sorted({span for route in routes for span in route.accepts or []}))
            no_fallback = (f"the tuned runners here take batch {sizes} only, and ONNX Runtime, which runs the "
                           f"others, cannot run here ({problem}): pad to a size they take")
            notes.append(f"batches other than {sizes} are refused: {problem}")
    notes.append("tuned: " + ", ".join(f"batch {route.batch} -> {route.label}" for route in routes))
    return TunedRunner(bundle, device, routes, fallback, notes, no_fallback)


def _options_for(backend: str, ort_options: dict, op_library: bool) -> dict:
    """The caller's options that ``backend`` takes (OpenVINO: its thread count)."""
    if backend == "onnxruntime":
        return {**ort_options, "op_library": op_library}
    if backend == "openvino":
        return {name: value for name, value in ort_options.items() if name in openvino.OPTIONS}
    return {}


def _sizes(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(str(low) if low == high else f"{low}..{high}" for low, high in ranges)


def tuned_convolutions(tuning: dict) -> bool:
    """Whether the tuned graph has convolutions, as its choices tell (NHWC kernels were among the
    candidates only then): the graph is not read again to match the choices with the candidates."""
    return any("prefer_nhwc" in choice["options"] for choice in tuning["choices"])
