"""What runners take and give: inputs classified without copying and checked against the
manifest (runtimes report mismatches obscurely), outputs in the form the inputs came in.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Mapping  # not typing.Mapping, whose isinstance() costs more
from pathlib import Path

import numpy as np

from deploykit.errors import BadInputError
from deploykit.specs import InputSpec
from deploykit.validation.inputs import cast_input, dtype_mismatch, random_feeds, read_arrays


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class Feed:
    """One input as given: host (numpy view) or device (pointer), and whether it came from torch."""

    name: str
    value: object
    shape: tuple[int, ...]
    dtype: np.dtype
    on_device: bool
    torch_device: str | None = None  # "cpu", "cuda:0"... for torch tensors

    def host(self) -> np.ndarray:
        if not self.on_device:
            return self.value
        if self.torch_device is None:
            raise BadInputError(f"input {self.name} is a CUDA array but this runner runs on the CPU: "
                                "pass a numpy array, or load the bundle with device='cuda'")
        return self.value.cpu().numpy()

    @property
    def pointer(self) -> int:
        if not self.on_device:
            return self.value.ctypes.data
        if self.torch_device is not None:
            return self.value.data_ptr()
        return self.value.__cuda_array_interface__["data"][0]


def imported_torch():
    return sys.modules.get("torch")  # a torch tensor can only exist when torch is imported


def _torch_dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=None)
def numpy_dtype_of_torch(dtype) -> np.dtype:
    """numpy's dtype of a torch dtype (bfloat16 as ``numpy_dtype`` gives it). Cached: a call's inputs
    are classified on every call, on the GPU's latency path."""
    return numpy_dtype(_torch_dtype_name(dtype))


@functools.lru_cache(maxsize=None)
def _device_name(device) -> str:
    """Cached: str() of a torch.device costs more than this lookup, on every CUDA input of every call."""
    return str(device)


def as_feed(name: str, value, *, aligned: bool = True) -> Feed:
    """Classify one input value without copying it (torch CPU tensors become numpy views), except a
    misaligned host array, copied when ``aligned`` (a runner's feed must be)."""
    torch = imported_torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return _torch_feed(name, value, torch)
    interface = getattr(value, "__cuda_array_interface__", None)
    if interface is not None:
        if interface.get("strides") not in (None, _c_strides(interface)):
            raise BadInputError(f"input {name} is a non-contiguous CUDA array: pass a contiguous one")
        return Feed(name, value, tuple(interface["shape"]), np.dtype(interface["typestr"]), True)
    array = np.ascontiguousarray(value)
    if aligned and not array.flags.aligned:  # a view at an odd offset of a byte buffer (an HTTP body): kernels need
        array = array.copy()     # element-aligned pointers, and ONNX Runtime passes numpy's own
    return Feed(name, array, array.shape, array.dtype, False)


def _torch_feed(name: str, tensor, torch) -> Feed:
    """A torch tensor's feed, detached only when it requires grad: detach() makes a new tensor
    object on every call, though only one that requires grad has anything to detach (and numpy()
    refuses only that one). contiguous() returns the tensor itself when it is contiguous already."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        raise BadInputError(f"input {name} is bfloat16: deploykit bundles take the dtype in their manifest")
    dtype = numpy_dtype_of_torch(tensor.dtype)
    if tensor.is_cuda:
        return Feed(name, tensor, tuple(tensor.shape), dtype, True, _device_name(tensor.device))
    return Feed(name, tensor.numpy(), tuple(tensor.shape), dtype, False, "cpu")


def _c_strides(interface: dict) -> tuple[int, ...]:
    itemsize, strides, step = np.dtype(interface["typestr"]).itemsize, [], 1
    for dim in reversed(interface["shape"]):
        strides.append(step * itemsize)
        step *= dim
    return tuple(reversed(strides))


def collect_feeds(feeds, named: Mapping, specs: list[dict], *, aligned: bool = True) -> dict[str, Feed]:
    """Inputs by name (a dict, keywords, or one bare array for a one-input model), checked.
    ``aligned=False`` leaves misaligned arrays as they are: for a caller that only checks them."""
    given = gathered_feeds(feeds, named, specs, aligned=aligned)
    check_feeds(given, specs)
    return given


def gathered_feeds(feeds, named: Mapping, specs: list[dict], *, aligned: bool = True) -> dict[str, Feed]:
    """Inputs by name, in the specs' order, classified but not yet checked (``check_feeds``)."""
    if feeds is not None and not isinstance(feeds, Mapping):
        if len(specs) != 1:
            raise BadInputError(f"the model takes {len(specs)} inputs ({', '.join(s['name'] for s in specs)}): "
                                "pass them by name")
        feeds = {specs[0]["name"]: feeds}
    given = _merged(feeds, named)
    names = [spec["name"] for spec in specs]
    if given.keys() != set(names):
        unknown, missing = sorted(set(given) - set(names)), [n for n in names if n not in given]
        problem = f"no input named {', '.join(unknown)}" if unknown else f"missing {', '.join(missing)}"
        raise BadInputError(f"{problem}; the model takes {describe_inputs(specs)}")
    return {name: as_feed(name, given[name], aligned=aligned) for name in names}


def given_batch(feeds, named: Mapping, specs: list[dict]) -> int | None:
    """The batch of a call's first input (1 for a scalar), read without checking or copying it, for a
    runner that hands the call on to one that checks it; None where that input is not given."""
    if feeds is not None and not isinstance(feeds, Mapping):
        value = feeds
    else:
        value = _merged(feeds, named).get(specs[0]["name"])
    if value is None:
        return None
    interface = getattr(value, "__cuda_array_interface__", None)
    shape = interface["shape"] if interface is not None else np.shape(value)
    return int(shape[0]) if len(shape) else 1


def _merged(feeds: Mapping | None, named: Mapping) -> Mapping:
    """A call's inputs given by mapping and by keyword, in one mapping; the one given as it is when
    the other is empty, as a call gives one or the other (a new dict for every call costs)."""
    if not named:
        return feeds or named
    return {**feeds, **named} if feeds else named


def describe_inputs(specs: list[dict]) -> str:
    return ", ".join(f"{s['name']} ({s['dtype']}, {'x'.join(map(str, s['shape']))})" for s in specs)


@functools.lru_cache(maxsize=None)
def numpy_dtype(name: str) -> np.dtype:
    """numpy's dtype of a manifest (or torch) dtype name: bfloat16 through ml_dtypes, which onnx installs.
    Cached: a server asks for every request."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def check_feeds(given: Mapping[str, Feed], specs: list[dict]) -> None:
    """``check_feed`` for every input, once all are classified (as ``as_feed`` refuses first)."""
    for spec in specs:
        check_feed(given[spec["name"]], spec)


def check_feed(feed: Feed, spec: dict) -> None:
    """Dtype, rank and static sizes must match the manifest (runtimes report these obscurely).
    No cast here: the caller holds the array and decides what a cast may lose."""
    if feed.dtype != _spec_dtype(spec["dtype"]):
        raise BadInputError(f"{dtype_mismatch(feed.name, feed.dtype, spec['dtype'])}: convert it first "
                            f"(e.g. x.astype(numpy.{spec['dtype']}))")
    if not _shape_fits(feed.shape, spec["shape"]):
        want = "x".join(map(str, spec["shape"]))
        raise BadInputError(f"input {feed.name} has shape {'x'.join(map(str, feed.shape))}, the model takes {want}")


def _shape_fits(shape: tuple[int, ...], wanted: list) -> bool:
    """The rank, and every static size (a positive int in the spec). A loop, not any() over a
    generator, whose frames cost more than the comparisons, for every input of every call."""
    if len(shape) != len(wanted):
        return False
    for size, dim in zip(shape, wanted):
        if isinstance(dim, int) and dim > 0 and dim != size:
            return False
    return True


@functools.lru_cache(maxsize=None)
def _spec_dtype(name: str) -> np.dtype:
    return np.dtype(name)


def batch_outside_range(feed: Feed, spec: dict) -> str | None:
    """The one batch rule: the manifest's dynamic range is what conversion validated and what
    engines were built for. Says how ``feed`` lies outside it, None when inside (or static)."""
    batch = spec.get("dynamic", {}).get("0")
    if batch and not batch["min"] <= feed.shape[0] <= batch["max"]:
        return f"input {feed.name} has batch {feed.shape[0]}, outside {batch['min']}..{batch['max']}"
    return None


def check_batch_range(feed: Feed, spec: dict) -> None:
    """Engines cannot run a batch outside the range they were built for, whatever the caller allows."""
    problem = batch_outside_range(feed, spec)
    if problem:
        raise BadInputError(f"{problem}, the batches the engine was built for: convert with a wider --batch")


def unvalidated_batch_notes(given: Mapping[str, Feed], specs: list[dict], allow_unvalidated: bool) -> list[str]:
    """A batch the bundle was not validated at is refused, or, when the caller allows it, named
    in the notes this returns, so that no output of an unvalidated batch goes unmarked."""
    problems = [problem for spec in specs if (problem := batch_outside_range(given[spec["name"]], spec))]
    if problems and not allow_unvalidated:
        raise BadInputError(f"{problems[0]}, the batches the bundle was validated for: convert with a wider "
                            "--batch, or pass --allow-unvalidated (Python: allow_unvalidated=True) to run it anyway")
    return [f"{problem}: its outputs were not validated (the bundle was validated for that range only)"
            for problem in problems]


def batch_sizes(specs: list[dict]) -> tuple[int, int, int] | None:
    """(min, opt, max) of the dynamic batch the bundle was converted with, None when static."""
    batch = specs[0].get("dynamic", {}).get("0") if specs else None
    return (batch["min"], batch["opt"], batch["max"]) if batch else None


def random_inputs(specs: list[dict], batch: int | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random inputs at ``batch`` (default: the optimum of a dynamic batch)."""
    dynamic = batch_sizes(specs)
    batch = batch or (dynamic[1] if dynamic else None)
    shapes = []
    for spec in specs:
        dims = [d if isinstance(d, int) and d > 0 else None for d in spec["shape"]]
        if batch is not None and dims:
            dims[0] = batch
        if any(d is None for d in dims):
            raise BadInputError(f"input {spec['name']} has dynamic sizes {spec['shape']}: give inputs as .npz (--inputs)")
        shapes.append(InputSpec(spec["name"], tuple(dims), spec["dtype"]))
    return random_feeds(shapes, seed)


def bundle_feeds(specs: list[dict], path: Path | None, batch: int | None = None, seed: int = 0, *,
                 rounding_notes: list[str] | None = None) -> dict[str, np.ndarray]:
    """Inputs for a bundle: a user's .npz (every array an input, cast only where exact) or random ones.

    Given ``rounding_notes`` (validate: its PyTorch reference runs the same rounded values), a
    float input may round to the bundle's narrower float dtype, noted there instead of refused.
    """
    if path is None:
        return random_inputs(specs, batch, seed)
    arrays = read_arrays(path)
    names = [spec["name"] for spec in specs]
    missing, unknown = [n for n in names if n not in arrays], [n for n in arrays if n not in names]
    if missing:
        raise BadInputError(f"--inputs {path} lacks {', '.join(missing)} (it holds {', '.join(arrays) or 'nothing'}); "
                            f"the model takes {describe_inputs(specs)}")
    if unknown:
        raise BadInputError(f"--inputs {path} holds {', '.join(unknown)}, which the model has no input for; "
                            f"the model takes {describe_inputs(specs)}: leave {', '.join(unknown)} out of the .npz")
    return {spec["name"]: cast_input(spec["name"], arrays[spec["name"]], spec["dtype"], path, rounding_notes)
            for spec in specs}


# --------------------------------------------------------------------------- outputs


class DeviceArray:
    """A CUDA buffer owned by the runtime (cuda-python or an OrtValue), shared through
    ``__cuda_array_interface__`` so CuPy, Numba or torch can wrap it without a copy."""

    def __init__(self, pointer: int, shape, dtype, owner=None, free=None):
        self.pointer, self.shape, self.dtype = int(pointer), tuple(int(d) for d in shape), np.dtype(dtype)
        self._owner, self._free = owner, free

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.pointer, False),
                "strides": None, "version": 3}

    def __del__(self):
        if self._free is not None:
            self._free(self.pointer)


def output_kind(feeds: dict[str, Feed]) -> tuple[str, str | None]:
    """What run() returns: ("torch", device) for torch inputs, ("device", None) for other CUDA
    arrays, ("numpy", None) otherwise."""
    for feed in feeds.values():
        if feed.torch_device is not None:
            return "torch", feed.torch_device
    if any(feed.on_device for feed in feeds.values()):
        return "device", None
    return "numpy", None


def deliver_host(array: np.ndarray, kind: str, device: str | None):
    """A host output in the form the caller gave its inputs."""
    if kind == "torch":
        tensor = imported_torch().from_numpy(np.ascontiguousarray(array))
        return tensor if device == "cpu" else tensor.to(device)
    if kind == "device":
        raise BadInputError("CUDA-array inputs need a CUDA runner: load the bundle with device='cuda'")
    return array
