"""Build the demo model: torchvision's resnet18 with random weights and random BatchNorm
statistics (no weights can be downloaded here), saved as a torch.export program.

Usage: python examples/resnet18/build_model.py OUT.pt2
"""

import sys

import torch
import torchvision

from deploykit.testing import randomize_batch_norm


def main(path: str) -> None:
    torch.manual_seed(0)
    model = randomize_batch_norm(torchvision.models.resnet18(), seed=0)
    example = torch.randn(2, 3, 224, 224)
    batch = torch.export.Dim("batch", min=1, max=16)
    program = torch.export.export(model, (example,), dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, path)
    print(f"wrote {path}: resnet18 (random weights, random BatchNorm statistics), dynamic batch 1..16")


if __name__ == "__main__":
    main(sys.argv[1])
