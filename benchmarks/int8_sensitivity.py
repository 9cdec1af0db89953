"""How far a random-weight classifier's top-1 moves under perturbations far milder than int8.

    python benchmarks/int8_sensitivity.py [--model resnet50] [--check 64] [--out results/sensitivity.json]

Issue 26 asks an int8 resnet50 to agree with fp32 PyTorch on top-1 for >= 99 % of images. With random
weights (BatchNorm statistics measured on random images, as ``bench_int8_cpu.py`` builds it) both
deploykit's int8 and OpenVINO's NNCF int8 agree on 0.891. This script asks whether any int8 could do
better on this model, by perturbing the fp32 model in PyTorch, one way at a time, and measuring
top-1 agreement and cosine against the unperturbed logits on ``--check`` random images (seed 99, as
the benchmark's accuracy check):

- ``weights int8``: every convolution's and linear layer's weights rounded to int8, per output
  channel, symmetric (the weight half of deploykit's int8; activations stay fp32);
- ``input uint8``: the input rounded to 256 levels over its range (the first QuantizeLinear only);
- ``input noise 1e-3`` / ``1e-2``: Gaussian noise at 0.1 % / 1 % of the input's standard deviation;
- ``float64``: the model in double precision (the floor: float32's own rounding).

It also prints the logits' top-1 margin (top-1 minus top-2 logit) over their standard deviation:
small margins are what make top-1 fragile.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_int8_cpu import agreement, calibrated_model  # noqa: E402


def int8_weights(model):
    """A copy with each Conv/Linear weight rounded to int8 per output channel (symmetric, scale = max|w| / 127)."""
    import torch

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
                weight = module.weight
                scale = weight.abs().flatten(1).amax(1).clamp_min(1e-12) / 127
                shape = (-1,) + (1,) * (weight.dim() - 1)
                weight.copy_(torch.round(weight / scale.view(shape)).clamp(-127, 127) * scale.view(shape))
    return rounded


def uint8_input(images: np.ndarray) -> np.ndarray:
    low, high = float(images.min()), float(images.max())
    scale = (high - low) / 255
    return (np.round((images - low) / scale) * scale + low).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(prog="int8_sensitivity.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--check", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torch

    model = calibrated_model(args.model, args.image).eval()
    images = np.random.default_rng(99).standard_normal((args.check, 3, args.image, args.image), dtype=np.float32)
    noise = np.random.default_rng(7).standard_normal(images.shape, dtype=np.float32) * images.std()

    def logits(net, x: np.ndarray, dtype=torch.float32) -> np.ndarray:
        with torch.no_grad():
            return np.concatenate([net(torch.from_numpy(x[i:i + 8]).to(dtype)).double().numpy()
                                   for i in range(0, len(x), 8)])

    reference = logits(model, images)
    top2 = np.sort(reference, axis=1)[:, -2:]
    margins = (top2[:, 1] - top2[:, 0]) / reference.std(axis=1)
    print(f"{args.model}, {args.check} random images: top-1 margin / logit std: median {np.median(margins):.3f}, "
          f"10th percentile {np.percentile(margins, 10):.3f}")
    cases = {
        "float64": lambda: logits(copy.deepcopy(model).double(), images, torch.float64),
        "input noise 1e-3": lambda: logits(model, images + 1e-3 * noise),
        "input noise 1e-2": lambda: logits(model, images + 1e-2 * noise),
        "input uint8": lambda: logits(model, uint8_input(images)),
        "weights int8": lambda: logits(int8_weights(model), images),
    }
    results = {"model": args.model, "check": args.check, "margin_median": float(np.median(margins)),
               "margin_p10": float(np.percentile(margins, 10)), "cases": {}}
    for name, perturbed in cases.items():
        metrics = agreement(perturbed(), reference)
        results["cases"][name] = metrics
        print(f"{name:18s} top-1 {metrics['top1_agreement']:.3f}  cosine {metrics['cosine']:.5f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
