"""The contract every runner follows, whichever backend it runs: callers depend on this only.

A runner is made from what a loader opened (an ONNX Runtime session, a TensorRT engine, a
PyTorch module); its input and output metadata come from there, or from the bundle's manifest
when a bundle loader passes it (the manifest also knows the batch range).
"""

from __future__ import annotations

from deploykit.backends.base.feeds import Feed, check_feeds, gathered_feeds, unvalidated_batch_notes


class Runner:
    """``run(feeds)`` / ``runner(x=...)`` -> {output name: array}; a context manager.

    ``inputs`` and ``outputs`` are specs ({"name", "dtype", "shape"}, optionally "dynamic");
    ``notes`` say what differs from the conversion, ``warnings`` the notes that ``load`` also
    issues as warnings. ``bundle`` is the Bundle the runner was loaded from, if any.
    """

    backend = "?"
    allow_unvalidated = False  # run batches outside the validated range, noting them (refused otherwise)

    def __init__(self, device: str, inputs: list[dict], outputs: list[dict], *, notes: list[str] | None = None,
                 name: str | None = None, bundle=None):
        self.device, self.bundle = device, bundle
        self.inputs, self.outputs = inputs, outputs
        self.input_names = [spec["name"] for spec in inputs]
        self.output_names = [spec["name"] for spec in outputs]
        self.notes = list(notes or [])
        self.warnings: list[str] = []
        self.name = name or f"{self.backend}-{device}"  # how a validation names this runner
        self._passed: set[tuple] = set()  # the inputs' (shape, dtype)s that passed checked_feeds' checks

    def run(self, feeds=None, /, **named) -> dict:
        raise NotImplementedError

    def checked_feeds(self, feeds, named) -> dict[str, Feed]:
        """A call's inputs checked against the specs; a batch outside the validated range is refused,
        or, with ``allow_unvalidated``, named once in ``notes``.

        The checks read the inputs' shapes and dtypes only, so inputs whose shapes and dtypes passed
        them all, inside the validated range, pass without them the next time: a server's calls
        repeat a few shapes. An unvalidated batch is checked on every call, so its note stays."""
        given = gathered_feeds(feeds, named, self.inputs)
        signature = tuple([(feed.shape, feed.dtype) for feed in given.values()])
        if signature in self._passed:
            return given
        check_feeds(given, self.inputs)
        notes = unvalidated_batch_notes(given, self.inputs, self.allow_unvalidated)
        for note in notes:
            if note not in self.notes:
                self.notes.append(note)
        if not notes:
            self._passed.add(signature)
        return given

    def __call__(self, feeds=None, /, **named) -> dict:
        return self.run(feeds, **named)

    def describe(self) -> dict:
        bundle = str(self.bundle.path) if self.bundle is not None else None
        return {"bundle": bundle, "backend": self.backend, "device": self.device, "notes": self.notes}

    def warn(self, note: str) -> None:
        """A note that ``load`` also issues as a warning."""
        self.notes.append(note)
        self.warnings.append(note)

    def close(self) -> None:
        """Release what the runner holds; runners also work without calling it."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
