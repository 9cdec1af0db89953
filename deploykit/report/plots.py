"""Error histogram for the conversion report's HTML page, as PNG bytes."""

from __future__ import annotations

import numpy as np

from deploykit.report.figures import plt, png_bytes
from deploykit.validation.compare import OutputComparison


def error_histogram_png(outputs: list[OutputComparison], title: str) -> bytes:
    """Histogram of log10 |reference - candidate| per output (exact matches counted in the legend)."""
    figure, axes = plt.subplots(figsize=(7.5, 3.2), dpi=110)
    for output in outputs:
        errors = output.abs_error_sample
        nonzero = errors[errors > 0]
        label = f"{output.name} ({errors.size - nonzero.size} of {errors.size} sampled exact)"
        axes.hist(np.log10(nonzero) if nonzero.size else [], bins=60, histtype="step", linewidth=1.4, label=label)
        if output.tolerance.atol:  # int8's defaults have no elementwise bound
            axes.axvline(np.log10(output.tolerance.atol), linestyle="--", linewidth=1, color="grey")
    axes.set_xlabel("log10 |reference - candidate|  (dashed: atol)")
    axes.set_ylabel("elements")
    axes.set_title(title, fontsize=10)
    if outputs:
        axes.legend(fontsize=8)
    return png_bytes(figure)
