"""Error histogram for the HTML report, rendered to an embeddable PNG (matplotlib, no display)."""

from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from deploykit.validation.compare import OutputComparison  # noqa: E402

def error_histogram_png(outputs: list[OutputComparison], title: str) -> str:
    """Histogram of log10 |reference - candidate| per output (exact matches counted in the legend)."""
    figure, axes = plt.subplots(figsize=(7.5, 3.2), dpi=110)
    for output in outputs:
        errors = output.abs_error_sample
        nonzero = errors[errors > 0]
        label = f"{output.name} ({errors.size - nonzero.size} of {errors.size} sampled exact)"
        axes.hist(np.log10(nonzero) if nonzero.size else [], bins=60, histtype="step", linewidth=1.4, label=label)
        atol = output.tolerance.atol
        axes.axvline(np.log10(atol), linestyle="--", linewidth=1, color="grey")
    axes.set_xlabel("log10 |reference - candidate|  (dashed: atol)")
    axes.set_ylabel("elements")
    axes.set_title(title, fontsize=10)
    if outputs:
        axes.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode("ascii")
