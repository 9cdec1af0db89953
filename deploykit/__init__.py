"""deploykit: convert PyTorch models into validated deployment bundles, and run them (``deploykit.load``)."""

__all__ = ["load"]


def __getattr__(name: str):
    """Import the runtime only when ``deploykit.load`` is used: the CLI starts faster without it."""
    if name == "load":
        from deploykit.runtime import load

        return load
    raise AttributeError(f"module 'deploykit' has no attribute {name!r}")
