"""A GPU whose CUDA context this process has lost. After a device-side assert (an embedding given an
id beyond its table), an illegal address or a launch failure, every later CUDA call of the process
fails with the same error: a server that goes on answering 500 to everything only hides it, behind
a health endpoint that still says ready. So a failed run on a GPU is followed by a probe of its
device, and where the probe fails too the server stops with the reason (exit 3), for whatever
supervises it to start a new process.
"""

from __future__ import annotations

from deploykit.errors import error_summary


def lost_context(device: str) -> str | None:
    """Why ``device``'s CUDA context no longer works (the probe's error), or None where it does or
    cannot be probed (no torch with CUDA here)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    try:
        torch.cuda.synchronize(device)
    except Exception as error:  # noqa: BLE001 - torch.AcceleratorError, or RuntimeError in older torch
        return error_summary(error)
    return None


def lost_message(model: str, device: str, why: str) -> str:
    return (f"{model} on {device}: this process's CUDA context is lost ({why}), so every later run would fail; "
            "the server stops: start it again (an input outside what the model accepts, such as a token id "
            "beyond its vocabulary, is the usual cause)")
