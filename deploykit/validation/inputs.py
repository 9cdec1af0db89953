"""Input data for validation: seeded random tensors within the declared shapes, or a user .npz."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from deploykit.errors import BadInputError
from deploykit.specs import InputSpec


def random_feeds(specs: list[InputSpec], seed: int) -> dict[str, np.ndarray]:
    """Standard-normal floats, small non-negative integers (valid as indices), random bools."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in specs:
        try:
            feeds[spec.name] = _random_array(rng, spec)
        except MemoryError:
            raise BadInputError(f"random input {spec.describe()} does not fit in this machine's memory; "
                                "use a smaller --batch, or give inputs as .npz (--inputs)") from None
    return feeds


def _random_array(rng: np.random.Generator, spec: InputSpec) -> np.ndarray:
    dtype = np.dtype(spec.dtype)
    if dtype.kind == "f":
        return rng.standard_normal(spec.shape, dtype=np.float32).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 8, spec.shape).astype(dtype)
    return rng.integers(0, 2, spec.shape).astype(bool)


def read_arrays(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of a user's ``.npz`` by name; refused when it is not an archive of non-empty arrays."""
    path = Path(path)
    fix = "save with numpy.savez(PATH, NAME=array, ...)"
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise BadInputError(f"--inputs {path} holds a single array (.npy), not named arrays; {fix}")
        with loaded as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise BadInputError(f"--inputs {path}: cannot read it as .npz ({error}); {fix}") from None
    empty = [name for name, array in arrays.items() if array.size == 0]
    if empty:
        raise BadInputError(f"--inputs {path}: {', '.join(empty)} holds no values (shape "
                            f"{'x'.join(map(str, arrays[empty[0]].shape))}); give at least one sample")
    return arrays


def load_feeds(path: str | Path, specs: list[InputSpec]) -> dict[str, np.ndarray]:
    """Read a user's ``.npz`` and check it holds every declared input with a fitting shape."""
    arrays = read_arrays(path)
    missing = [spec.name for spec in specs if spec.name not in arrays]
    if missing:
        raise BadInputError(
            f"--inputs {path} lacks {', '.join(missing)} (it holds {', '.join(arrays) or 'nothing'}); "
            "name the arrays after the model's inputs"
        )
    feeds = {}
    for spec in specs:
        array = arrays[spec.name]
        if array.shape[1:] != spec.shape[1:] or array.ndim != len(spec.shape):
            raise BadInputError(
                f"--inputs {path}: {spec.name} has shape {'x'.join(map(str, array.shape))}, "
                f"the model takes {'x'.join(map(str, spec.shape))} (any batch size)"
            )
        feeds[spec.name] = array.astype(spec.dtype, copy=False)
    return feeds


def batch_size(feeds: dict[str, np.ndarray]) -> int:
    """The batch of a feed set (dimension 0 of its first input)."""
    return int(next(iter(feeds.values())).shape[0])
