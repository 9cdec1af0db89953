"""What every runner offers, whichever backend it runs: callers depend on this surface only."""

from __future__ import annotations

from deploykit.bundle.read import Bundle


class Runner:
    """Common surface: ``run(feeds)`` / ``runner(x=...)`` -> {output name: array}."""

    backend = "?"

    def __init__(self, bundle: Bundle, device: str, notes: list[str]):
        self.bundle, self.device, self.notes = bundle, device, notes
        self.warnings: list[str] = []  # the notes load() also issues as warnings: what differs from conversion
        self.inputs, self.outputs = bundle.inputs, bundle.outputs
        self.input_names = [spec["name"] for spec in self.inputs]
        self.output_names = [spec["name"] for spec in self.outputs]

    @property
    def name(self) -> str:
        """Backend and device, e.g. onnxruntime-cuda:0: how a validation names this runner."""
        return f"{self.backend}-{self.device}"

    def run(self, feeds=None, /, **named) -> dict:
        raise NotImplementedError

    def __call__(self, feeds=None, /, **named) -> dict:
        return self.run(feeds, **named)

    def describe(self) -> dict:
        return {"bundle": str(self.bundle.path), "backend": self.backend, "device": self.device, "notes": self.notes}

    def _warn(self, note: str) -> None:
        self.notes.append(note)
        self.warnings.append(note)

    def close(self) -> None:
        """Release what the runner holds; runners also work without calling it."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
