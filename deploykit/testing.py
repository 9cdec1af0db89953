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
