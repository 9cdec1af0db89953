"""Helpers for realistic test and example models.

Freshly built models have BatchNorm running mean 0 and variance 1, which makes a wrong
fold (say, scaling by the wrong axis) invisible; trained models never look like that.
"""

from __future__ import annotations

import torch


def randomize_batch_norm(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every BatchNorm random running statistics and affine parameters, as training would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
                size = module.num_features
                module.running_mean.copy_(torch.randn(size, generator=generator) * 0.5)
                module.running_var.copy_(torch.rand(size, generator=generator) * 1.5 + 0.5)
                if module.affine:
                    module.weight.copy_(torch.rand(size, generator=generator) * 1.5 + 0.5)
                    module.bias.copy_(torch.randn(size, generator=generator) * 0.2)
    return model.eval()


def calibrate_batch_norm(model: torch.nn.Module, inputs: list[torch.Tensor], seed: int = 0) -> torch.nn.Module:
    """Random affine parameters, then running statistics measured on ``inputs`` (as training leaves them).

    Random statistics (above) let activations of a deep random network grow to ~1e4, which no
    trained model has and which fp16 cannot hold; measured statistics keep them trained-sized
    while mean and variance stay far from 0 and 1.
    """
    randomize_batch_norm(model, seed)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    momenta = [norm.momentum for norm in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a cumulative average over all the batches
    model.train()
    with torch.no_grad():
        for batch in inputs:
            model(batch)
    for norm, momentum in zip(norms, momenta):
        norm.momentum = momentum
    return model.eval()
