"""Which outputs a validation proves nothing about: those that do not depend on the input.

Matching PyTorch proves the layers an output depends on. An output that is the same for every
validation input -- torchvision's vit_b_16 built from scratch gives 0 for every image, as its
head is initialised to zeros -- is matched by any graph that returns that constant, whatever the
graph does to the layers before, so its comparison is inconclusive.
"""

from __future__ import annotations

import numpy as np

from deploykit.specs import InputSpec
from deploykit.validation.inputs import batch_size, random_feeds

#: Samples closer than this share of the output's magnitude are one value (fp32 rounding of a constant).
SAME_VALUE_SHARE = 1e-6
#: Seed of the extra random input run when the validation inputs give an output fewer than two samples.
PROBE_SEED = 7919
SUGGESTION = ("its comparison proves nothing about the layers before it: validate on real data "
              "(--inputs data.npz) with a trained checkpoint")


def inconclusive_outputs(reference, feed_sets: list[dict], references: list[dict]) -> dict[str, str]:
    """Output name -> why its comparison is inconclusive (0, or the same, for every input).

    ``references``: the reference's outputs on ``feed_sets``. Where those hold a single sample of
    an output (one input of batch 1), the reference also runs on one seeded random input.
    """
    samples = {name: _samples(name, feed_sets, references) for name in references[0]}
    if any(len(rows) < 2 for rows in samples.values()):
        probe_feeds, probe = _probe(reference, feed_sets[0])
        for name in probe:
            samples[name] += _samples(name, [probe_feeds], [probe])
    reasons = {name: _reason(rows) for name, rows in samples.items()}
    return {name: reason for name, reason in reasons.items() if reason}


def _samples(name: str, feed_sets: list[dict], references: list[dict]) -> list[np.ndarray]:
    """The output for each input: its rows where it has the batch dimension, else the whole array."""
    rows = []
    for feeds, outputs in zip(feed_sets, references):
        array, batch = np.asarray(outputs[name]), batch_size(feeds)
        rows.extend(array if array.ndim and array.shape[0] == batch else [array])
    return rows


def _probe(reference, feeds: dict) -> tuple[dict, dict]:
    """A seeded random input shaped like ``feeds`` and the reference's outputs on it (none for a
    model that rejects it)."""
    specs = [InputSpec(name, array.shape, array.dtype.name) for name, array in feeds.items()]
    probe = random_feeds(specs, PROBE_SEED)
    try:
        return probe, reference.run(probe)
    except Exception:  # a model that takes only real data (value ranges): judged on the given inputs alone
        return probe, {}


def _reason(rows: list[np.ndarray]) -> str | None:
    shapes = {row.shape for row in rows}
    if len(shapes) != 1 or rows[0].dtype.kind not in "fiub" or rows[0].size == 0:
        return None
    stacked = np.stack(rows).astype(np.float64)
    if not np.isfinite(stacked).all():
        return None  # NaN/Inf placement is compared by the validation itself
    magnitude = float(np.abs(stacked).max())
    if magnitude == 0.0:
        return (f"it is 0 on every input it ran on ({len(rows)}): a layer initialised to zero "
                "(a classifier head built from scratch, as torchvision's ViT has) or ReLUs that never fire; "
                f"{SUGGESTION}")
    if len(rows) < 2:
        return None
    spread = float(np.abs(stacked - stacked[0]).max())
    if spread > SAME_VALUE_SHARE * magnitude:
        return None
    return (f"it is the same on every input it ran on ({len(rows)}; spread {spread:.3g} at "
            f"magnitude {magnitude:.3g}): it does not depend on the input, as with random weights that "
            f"saturate or a zero-initialised layer before a bias; {SUGGESTION}")
