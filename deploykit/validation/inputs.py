"""Input data for validation: seeded random tensors within the declared shapes, or a user .npz.

A user's arrays are cast to the declared dtypes only where every value survives (:func:`cast_input`):
the one rule of ``--inputs`` in convert, debug, run and validate.
"""

from __future__ import annotations

import warnings
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


def read_arrays(path: str | Path, option: str = "--inputs") -> dict[str, np.ndarray]:
    """The arrays of a user's ``.npz`` by name; refused when it is not an archive of non-empty arrays
    (``option``: the flag that named the file, as the error names it)."""
    path = Path(path)
    fix = "save with numpy.savez(PATH, NAME=array, ...)"
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise BadInputError(f"{option} {path} holds a single array (.npy), not named arrays; {fix}")
        with loaded as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise BadInputError(f"{option} {path}: cannot read it as .npz ({error}); {fix}") from None
    empty = [name for name, array in arrays.items() if array.size == 0]
    if empty:
        raise BadInputError(f"{option} {path}: {', '.join(empty)} holds no values (shape "
                            f"{'x'.join(map(str, arrays[empty[0]].shape))}); give at least one sample")
    return arrays


def load_feeds(path: str | Path, specs: list[InputSpec], option: str = "--inputs") -> dict[str, np.ndarray]:
    """Read a user's ``.npz`` and check it holds every declared input with a fitting shape, each
    cast to its declared dtype only where no value changes (convert and debug compare on these;
    ``convert --calibration`` calibrates int8 on them)."""
    arrays = read_arrays(path, option)
    missing = [spec.name for spec in specs if spec.name not in arrays]
    if missing:
        raise BadInputError(
            f"{option} {path} lacks {', '.join(missing)} (it holds {', '.join(arrays) or 'nothing'}); "
            "name the arrays after the model's inputs"
        )
    feeds = {}
    for spec in specs:
        array = arrays[spec.name]
        if array.shape[1:] != spec.shape[1:] or array.ndim != len(spec.shape):
            raise BadInputError(
                f"{option} {path}: {spec.name} has shape {'x'.join(map(str, array.shape))}, "
                f"the model takes {'x'.join(map(str, spec.shape))} (any batch size)"
            )
        feeds[spec.name] = cast_input(spec.name, array, spec.dtype, path, option=option)
    return feeds


def dtype_mismatch(name: str, given: np.dtype, wanted: str) -> str:
    """How a refused dtype is named, by deploykit.load and every ``--inputs`` alike."""
    return f"input {name} is {given}, the model takes {wanted}"


def cast_input(name: str, array: np.ndarray, dtype: str, path: Path,
               rounding_notes: list[str] | None = None, option: str = "--inputs") -> np.ndarray:
    """``array`` as ``dtype`` when every value survives the cast (a .npz of Python numbers is
    float64 or int64); a cast that would change a value is refused, as deploykit.load refuses
    every cast, unless it only rounds floats and ``rounding_notes`` takes the note."""
    wanted = np.dtype(dtype)
    if array.dtype == wanted:
        return array
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", np.exceptions.ComplexWarning)  # what it warns of is checked below
        cast = array.astype(wanted)
        changed = _changed_by_cast(array, cast)
    if not changed.any():
        return cast
    if rounding_notes is not None and _only_rounded(array, cast):
        rounding_notes.append(f"{option} {path}: input {name} rounded from {array.dtype} to {dtype}, "
                              f"the bundle's input dtype ({int(changed.sum())} values changed)")
        return cast
    first = tuple(int(i) for i in np.argwhere(changed)[0])
    example = f"{array[first].item()!r} becomes {cast[first].item()!r}"
    raise BadInputError(f"{option} {path}: {dtype_mismatch(name, array.dtype, dtype)}, and the cast would change "
                        f"{int(changed.sum())} of its values (e.g. {example}): save it as {dtype}")


def _changed_by_cast(original: np.ndarray, cast: np.ndarray) -> np.ndarray:
    """Where a value does not come back from the cast: rounded, overflowed, wrapped, or an
    imaginary part dropped (NaN stays NaN)."""
    back = cast.astype(original.dtype)
    changed = back != original
    if original.dtype.kind in "fc":
        changed &= ~(np.isnan(original) & np.isnan(back))
    if original.dtype.kind == "c" and cast.dtype.kind != "c":
        changed |= original.imag != 0
    return changed


def _only_rounded(original: np.ndarray, cast: np.ndarray) -> bool:
    """Floats to floats with nothing finite becoming infinite: rounding, not overflow."""
    if not original.dtype.kind == cast.dtype.kind == "f":
        return False
    return not np.any(np.isfinite(original) & ~np.isfinite(cast))


def batch_size(feeds: dict[str, np.ndarray]) -> int:
    """The batch of a feed set (dimension 0 of its first input)."""
    return int(next(iter(feeds.values())).shape[0])
