"""matplotlib for reports: pyplot on the Agg backend (no display), figures saved as PNG bytes."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def png_bytes(figure) -> bytes:
    """``figure`` laid out and saved as PNG; the figure is closed (pyplot keeps no reference)."""
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


__all__ = ["plt", "png_bytes"]
