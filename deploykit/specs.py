"""What the user declares about the model's inputs: names, shapes, dtypes, batch range.

Parsed from the CLI strings ``NAME:1x3x224x224[:dtype]`` and ``MIN:OPT:MAX``.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from deploykit.errors import BadInputError

DTYPES = {
    "float32": np.float32,
    "fp32": np.float32,
    "float16": np.float16,
    "fp16": np.float16,
    "float64": np.float64,
    "int64": np.int64,
    "int32": np.int32,
    "bool": np.bool_,
}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


@dataclasses.dataclass(frozen=True)
class BatchRange:
    """Dynamic batch: engines are optimised for ``opt`` and accept ``min..max``."""

    min: int
    opt: int
    max: int

    @classmethod
    def parse(cls, text: str) -> BatchRange:
        parts = text.split(":")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise BadInputError(f"--batch {text!r} is not MIN:OPT:MAX; write e.g. --batch 1:8:32")
        lo, opt, hi = (int(p) for p in parts)
        if not 1 <= lo <= opt <= hi:
            raise BadInputError(
                f"--batch {text!r} needs 1 <= MIN <= OPT <= MAX; write e.g. --batch 1:8:32"
            )
        return cls(lo, opt, hi)

    def validation_sizes(self) -> list[int]:
        """Batch sizes validation runs: both ends of the range and the optimum."""
        return sorted({self.min, self.opt, self.max})

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One model input. ``shape[0]`` is the batch dimension when a batch range is set."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @classmethod
    def parse(cls, text: str) -> InputSpec:
        parts = text.split(":")
        example = "write e.g. --input x:1x3x224x224 or --input x:1x3x224x224:float16"
        if len(parts) not in (2, 3):
            raise BadInputError(f"--input {text!r} is not NAME:SHAPE[:DTYPE]; {example}")
        name, shape_text = parts[0], parts[1]
        dtype = parts[2] if len(parts) == 3 else "float32"
        if not _NAME.match(name):
            raise BadInputError(f"--input {text!r}: {name!r} is not a valid input name; {example}")
        dims = shape_text.lower().split("x")
        if not all(d.isdigit() and int(d) > 0 for d in dims):
            raise BadInputError(
                f"--input {text!r}: shape {shape_text!r} must be positive integers joined by 'x'; "
                f"{example}"
            )
        if dtype not in DTYPES:
            raise BadInputError(
                f"--input {text!r}: unknown dtype {dtype!r}; use one of {', '.join(sorted(DTYPES))}"
            )
        return cls(name, tuple(int(d) for d in dims), np.dtype(DTYPES[dtype]).name)

    def with_batch(self, batch: int) -> InputSpec:
        return dataclasses.replace(self, shape=(batch, *self.shape[1:]))

    def describe(self) -> str:
        return f"{self.name}:{'x'.join(map(str, self.shape))}:{self.dtype}"
