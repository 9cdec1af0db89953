"""PyTorch runner: the reference every conversion is validated against (fp32, CPU)."""

from __future__ import annotations

import copy

import numpy as np
import torch

from deploykit.errors import BadInputError
from deploykit.conversion.loading import LoadedModel
from deploykit.backends.base.runner import Runner


def flatten_outputs(result) -> list[torch.Tensor]:
    """Tensors of a forward() result in order: a tensor, nested tuples/lists, or dict values."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, dict):
        result = list(result.values())
    if isinstance(result, (tuple, list)):
        return [tensor for item in result for tensor in flatten_outputs(item)]
    raise BadInputError(
        f"the model returns a {type(result).__name__}; deploykit exports tensors, "
        "tuples/lists/dicts of tensors only"
    )


def default_output_names(count: int) -> list[str]:
    return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]


class TorchRunner(Runner):
    """Runs the loaded model on numpy feeds and names its outputs (float outputs as fp32).

    A module declares neither dtypes nor shapes, so its specs hold names only; the output
    names are the caller's to set (the exported graph's), else given on the first run.
    """

    backend = "pytorch"

    def __init__(self, loaded: LoadedModel, input_names: list[str], float_type: torch.dtype = torch.float32):
        exact = float_type == torch.float64
        super().__init__("cpu", [{"name": name} for name in input_names], [],
                         name="pytorch-float64" if exact else "pytorch")
        self.loaded = loaded
        self.output_names: list[str] | None = None
        self.float_type = float_type
        self.module = copy.deepcopy(loaded.module).double() if exact else loaded.module

    @property
    def outputs(self) -> list[dict]:
        return [{"name": name} for name in self.output_names or []]

    @outputs.setter
    def outputs(self, specs: list[dict]) -> None:
        self.output_names = [spec["name"] for spec in specs] or None

    def in_float64(self) -> TorchRunner:
        """A runner of a float64 copy of the model: the nearly exact result that tells the
        rounding error of fp32 itself. Fails (as PyTorch does) where the model fixes its dtypes."""
        exact = TorchRunner(self.loaded, self.input_names, torch.float64)
        exact.output_names = self.output_names
        return exact

    def run(self, feeds: dict[str, np.ndarray] | None = None, /, **named) -> dict[str, np.ndarray]:
        feeds = {**(feeds or {}), **named}
        args = [self._tensor(feeds[name]) for name in self.input_names]
        with torch.inference_mode():
            tensors = flatten_outputs(self.module(*args))
        if self.output_names is None:
            self.output_names = default_output_names(len(tensors))
        return {
            name: tensor.detach().to(self.float_type).numpy() if tensor.is_floating_point() else tensor.numpy()
            for name, tensor in zip(self.output_names, tensors)
        }

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """The feed as given, but widened where it is a narrower float than the run (the float64
        copy; the fp16 inputs of a bundle converted with --io-precision fp16)."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        narrower = tensor.is_floating_point() and torch.finfo(tensor.dtype).bits < torch.finfo(self.float_type).bits
        return tensor.to(self.float_type) if narrower else tensor
