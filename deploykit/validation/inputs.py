"""Input data for validation: seeded random tensors within the declared shapes, or a user .npz."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from deploykit.errors import BadInputError
from deploykit.specs import InputSpec


def random_feeds(specs: list[InputSpec], seed: int) -> dict[str, np.ndarray]:
    """Standard-normal floats, small non-negative integers (valid as indices), random bools."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for spec in specs:
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f":
            feeds[spec.name] = rng.standard_normal(spec.shape, dtype=np.float32).astype(dtype)
        elif dtype.kind in "iu":
            feeds[spec.name] = rng.integers(0, 8, spec.shape).astype(dtype)
        else:
            feeds[spec.name] = rng.integers(0, 2, spec.shape).astype(bool)
    return feeds


def load_feeds(path: str | Path, specs: list[InputSpec]) -> dict[str, np.ndarray]:
    """Read a user's ``.npz`` and check it holds every declared input with a fitting shape."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as error:
        raise BadInputError(f"--inputs {path}: cannot read it as .npz ({error}); save with numpy.savez") from None
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
