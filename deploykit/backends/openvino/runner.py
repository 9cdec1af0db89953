"""The OpenVINO runner: a compiled model on the CPU, numpy (or CPU torch tensors) in and out."""

from __future__ import annotations

import threading

import numpy as np

from deploykit.backends.base.feeds import deliver_host, output_kind
from deploykit.backends.base.runner import Runner
from deploykit.errors import DeployKitError


class OpenVinoRunner(Runner):
    """A compiled OpenVINO model fed by input name. Each thread gets its own infer request (a request
    runs one call at a time), so one runner serves several threads, as ONNX Runtime's session does.

    ``inputs``/``outputs`` are the manifest's specs (the batch range is enforced; ``allow_unvalidated``
    runs other batches, with a note); ``label`` names the model file in ``describe``.
    """

    backend = "openvino"

    def __init__(self, compiled, *, inputs: list[dict], outputs: list[dict], label: str,
                 notes: list[str] | None = None, name: str | None = None, bundle=None, allow_unvalidated: bool = False):
        super().__init__("cpu", inputs, outputs, notes=notes, name=name, bundle=bundle)
        self.compiled, self.label = compiled, label
        self.allow_unvalidated = allow_unvalidated
        self._ports = [self._output_port(spec["name"]) for spec in outputs]
        self._local = threading.local()

    def _output_port(self, name: str):
        for port in self.compiled.outputs:
            if name in port.get_names():
                return port
        found = [sorted(port.get_names()) for port in self.compiled.outputs]
        raise DeployKitError(f"the OpenVINO model has no output {name!r} (it has {found}); please report this")

    def describe(self) -> dict:
        return {**super().describe(), "model": self.label}

    def run(self, feeds=None, /, **named) -> dict:
        given = self.checked_feeds(feeds, named)
        kind, device = output_kind(given)
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        request.infer({name: np.ascontiguousarray(feed.host()) for name, feed in given.items()})
        return {spec["name"]: deliver_host(request.get_tensor(port).data.copy(), kind, device)
                for spec, port in zip(self.outputs, self._ports)}

    def close(self) -> None:
        self._local = threading.local()  # the infer requests and their buffers
