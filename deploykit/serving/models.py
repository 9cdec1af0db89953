"""The models a server holds: each bundle loaded by ``deploykit.load`` once per instance, so the
server runs exactly what was validated, and each request checked against the bundle's manifest
before it is queued (so a bad request never reaches a batch it would spoil for others).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from deploykit.backends.base.feeds import batch_outside_range, batch_sizes, collect_feeds
from deploykit.bundle.read import Bundle, open_bundle
from deploykit.errors import BadInputError
from deploykit.runtime.choose import parse_device
from deploykit.serving.placement import instance_devices, usable_cores
from deploykit.serving.protocol import RequestError, bad, tensor_metadata


@dataclasses.dataclass
class ServeOptions:
    """How each bundle is loaded and batched (the CLI's options)."""

    backend: str = "auto"
    devices: tuple[str, ...] = ("auto",)  # --device values, see serving.placement
    instances: int = 1
    max_batch: int | None = None  # None: the bundle's maximum batch
    buckets: str = "auto"  # auto | exact | validated | "1,2,4"
    allow_nan: bool = False
    trust_native: bool = False
    allow_failed: bool = False
    warmup_runs: int = 3  # per instance and warm-up batch size, before the server says ready
    threads: int | None = None  # ONNX Runtime's intra-op threads per instance (None: its default, every core)
    split_cores: bool = False  # serve --split-cores: also two runners on half the cores each (ServedModel.halves)


@dataclasses.dataclass
class ServedModel:
    """One bundle, its runners (one per instance) and the batching it allows."""

    name: str
    path: Path
    runners: list
    placements: list[str]  # the device each runner was loaded for
    max_batch: int  # rows per run; 1 when the bundle's batch is static
    buckets: list[int]  # the batch sizes runs are padded to; empty: run the rows as they come
    allow_nan: bool
    #: each worker's runs before it takes requests: ``warmup_runs`` at each of ``warmup_sizes``
    #: (None: the bundle's static shapes), so the first requests pay no algorithm search or CUDA graph capture
    warmup_sizes: list[int | None] = dataclasses.field(default_factory=list)
    warmup_runs: int = 0
    #: on a CPU (``ServeOptions.split_cores``): two more runners of the one instance, on half the cores each, so
    #: that while a second full batch waits two batches run side by side (the batcher's lanes); else empty
    halves: list = dataclasses.field(default_factory=list)

    @property
    def runner(self):
        return self.runners[0]

    @property
    def notes(self) -> list[str]:
        """What every instance's runner noted, each note once: instances on other devices may note
        other things (an engine one GPU cannot run), and the console names them all."""
        return list(dict.fromkeys(note for runner in self.runners for note in runner.notes))

    @property
    def inputs(self) -> list[dict]:
        return self.runner.inputs

    @property
    def outputs(self) -> list[dict]:
        return self.runner.outputs

    @property
    def gpus(self) -> list[int] | None:
        """The GPU of each instance; None on the CPU."""
        if self.runner.device != "cuda":
            return None
        return [parse_device(place)[1] for place in self.placements]

    @property
    def batching(self) -> bool:
        return self.max_batch > 1

    def metadata(self) -> dict:
        return {"name": self.name, "versions": ["1"], "platform": f"deploykit_{self.runner.backend}",
                "inputs": [tensor_metadata(s) for s in self.inputs],
                "outputs": [tensor_metadata(s) for s in self.outputs]}

    def check(self, inputs: dict[str, np.ndarray]) -> int:
        """The request's rows (its batch); RequestError naming what the manifest refuses."""
        try:
            feeds = collect_feeds(inputs, {}, self.inputs, aligned=False)  # checked here, aligned where batched
        except BadInputError as error:
            raise bad(str(error)) from None
        if not self.allow_nan:
            _refuse_non_finite(inputs)
        if batch_sizes(self.inputs) is None:
            return 1
        rows = {feed.shape[0] for feed in feeds.values()}
        if len(rows) > 1:
            raise bad(f"the inputs have different batch sizes ({', '.join(map(str, sorted(rows)))}): give every "
                      "input the same dimension 0")
        for spec in self.inputs:
            if problem := batch_outside_range(feeds[spec["name"]], spec):
                raise bad(f"{problem}, the batches the bundle was validated for: split the request")
        return rows.pop()


def _refuse_non_finite(inputs: dict[str, np.ndarray]) -> None:
    for name, array in inputs.items():
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            count = int(array.size - np.isfinite(array).sum())
            raise RequestError(400, f"input {name} holds {count} NaN or infinite values, which the bundle was not "
                                    "validated with (--allow-nan on serve or export triton passes them through)")


def load_models(paths: list[Path], options: ServeOptions) -> list[ServedModel]:
    """Every bundle, each under its folder's name, with ``options.instances`` runners placed round-robin."""
    names = [Path(p).resolve().name for p in paths]
    if len(set(names)) != len(names):
        raise BadInputError(f"two bundles are named {next(n for n in names if names.count(n) > 1)}: models are "
                            "named after their folders, so rename one")
    placements = instance_devices(options.devices, options.instances)
    return [load_model(open_bundle(path), name, placements, options) for path, name in zip(paths, names)]


def _ort_options(options: ServeOptions, place: str) -> dict:
    """``--threads``; and on a CPU, thread pools that stop spinning when a run returns: spinning on,
    they hold the cores the event loop needs to answer the batch and read the next (docs/serving.md)."""
    ort = {"threads": options.threads} if options.threads else {}
    if place == "cpu" and options.backend in ("auto", "onnxruntime"):
        ort["spin"] = False
    return ort


def load_model(bundle: Bundle, name: str, placements: list[str], options: ServeOptions) -> ServedModel:
    """One runner per placement, all of one opened ``bundle`` (each file is hashed once), and the
    batching they allow; ``serve`` and the Triton python model (one placement each) load alike."""
    from deploykit.runtime import load

    path = bundle.path
    runners = [load(bundle, options.backend, place, allow_failed=options.allow_failed,
                    trust_native=options.trust_native, **_ort_options(options, place)) for place in placements]
    dynamic = batch_range(runners[0].inputs, runners[0].outputs)
    if dynamic is None:
        return ServedModel(name, path, runners, placements, 1, [], options.allow_nan, [None], options.warmup_runs)
    low, _, high = dynamic
    max_batch = options.max_batch or high
    if not low <= max_batch <= high:
        raise BadInputError(f"--max-batch {max_batch} is outside {name}'s batch range {low}..{high}: "
                            "choose one in it (or convert with a wider --batch)")
    buckets = choose_buckets(options.buckets, runners[0], low, max_batch)
    halves = [load(bundle, options.backend, "cpu", allow_failed=options.allow_failed,
                   trust_native=options.trust_native, **_ort_options(options, "cpu"), threads=threads)
              for threads in _half_cores(options, runners)]
    return ServedModel(name, path, runners, placements, max_batch, buckets, options.allow_nan,
                       buckets or [max_batch], options.warmup_runs, halves)


def _half_cores(options: ServeOptions, runners: list) -> list[int]:
    """The threads of each half-core runner (``ServedModel.halves``): the two halves of this process's cores,
    where ``split_cores`` asks (refused unless one ONNX Runtime instance on a CPU of two or more cores holds them
    all); else none. Two batches side by side on one core each compute about as fast as two after each other on both
    cores, and they lose less to the requests parsed on the same cores meanwhile (BENCHMARKS.md, 2-core CPU)."""
    if not options.split_cores:
        return []
    if options.threads:
        raise BadInputError("--split-cores cannot apply: it comes with --threads; drop one of the two")
    if len(runners) != 1:
        raise BadInputError(f"--split-cores cannot apply: it splits one instance, not {len(runners)}; drop one of "
                            "the two")
    if (runners[0].device, runners[0].backend) != ("cpu", "onnxruntime"):
        raise BadInputError(f"--split-cores cannot apply: the model runs on {runners[0].backend} "
                            f"({runners[0].device}), not ONNX Runtime on a CPU; drop --split-cores")
    cores = usable_cores()
    if cores < 2:
        raise BadInputError("--split-cores cannot apply: this process has one core; drop --split-cores")
    return [cores // 2, cores - cores // 2]


def batch_range(inputs: list[dict], outputs: list[dict]) -> tuple[int, int, int] | None:
    """(min, opt, max) of the batch when runs of several requests can be batched: a dynamic batch
    and every output split by it; else None. ``serve`` and ``export triton`` both ask this, so a
    model batches alike in both."""
    dynamic = batch_sizes(inputs)
    if dynamic is None or not all(_follows_batch(spec, inputs) for spec in outputs):
        return None
    return dynamic


def _follows_batch(output: dict, inputs: list[dict]) -> bool:
    """Whether an output's dimension 0 is the inputs' batch (the same symbol), so a run can be split by rows."""
    first = output["shape"][0] if output["shape"] else None
    return (isinstance(first, str) and first == inputs[0]["shape"][0]) or "0" in output.get("dynamic", {})


def choose_buckets(choice: str, runner, low: int, max_batch: int) -> list[int]:
    """Batch sizes a run is padded up to. ``auto``: the validated sizes on a GPU (CUDA graphs and
    engines are fastest at sizes they were captured or tuned at), the exact rows on a CPU (padding
    there only adds work); ``validated``, ``exact`` or a list force one."""
    if choice == "auto":
        choice = "exact" if runner.device == "cpu" else "validated"
    if choice == "exact":
        return []
    if choice == "validated":
        return validated_buckets(runner.bundle.manifest if runner.bundle is not None else {}, low, max_batch)
    try:
        sizes = sorted({int(part) for part in choice.split(",") if part.strip()})
    except ValueError:
        raise BadInputError(f"--buckets {choice!r}: use auto, exact, validated or sizes like 1,4,16") from None
    if not sizes or sizes[0] < low or sizes[-1] > max_batch:
        raise BadInputError(f"--buckets {choice}: every size must lie in {low}..{max_batch}")
    return sorted(set(sizes) | {max_batch})


def validated_buckets(manifest: dict, low: int, max_batch: int) -> list[int]:
    """The batch sizes validated or tuned (``tuning.choices``) in ``low..max_batch``, and ``max_batch``:
    where engines and CUDA graphs were built, so a run padded up to one pays no build or capture."""
    sizes = manifest.get("validation", {}).get("batch_sizes", [])
    tuned = [c["batch"] for c in (manifest.get("tuning") or {}).get("choices", [])]
    return sorted({s for s in [*sizes, *tuned] if low <= s <= max_batch} | {max_batch})
