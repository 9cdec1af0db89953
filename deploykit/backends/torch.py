"""PyTorch runner: the reference every conversion is validated against (fp32, CPU)."""

from __future__ import annotations

import numpy as np
import torch

from deploykit.errors import BadInputError
from deploykit.loading import LoadedModel


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


class TorchRunner:
    """Runs the loaded model on numpy feeds and names its outputs."""

    name = "pytorch"

    def __init__(self, loaded: LoadedModel, input_names: list[str]):
        self.loaded = loaded
        self.input_names = input_names
        self.output_names: list[str] | None = None

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = [torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in self.input_names]
        with torch.inference_mode():
            tensors = flatten_outputs(self.loaded.module(*args))
        if self.output_names is None:
            self.output_names = default_output_names(len(tensors))
        return {
            name: tensor.detach().float().numpy() if tensor.is_floating_point() else tensor.numpy()
            for name, tensor in zip(self.output_names, tensors)
        }
