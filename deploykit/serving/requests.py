"""One infer request's way through the server, whatever protocol it came by (HTTP or gRPC): the
model it names, its tensors parsed and checked while the batcher knows it is arriving, queued,
its answer awaited within ``--timeout``, and its count in /metrics.
"""

from __future__ import annotations

import asyncio
import time

from deploykit.serving import access, protocol
from deploykit.serving.models import ServedModel
from deploykit.serving.protocol import RequestError

UNKNOWN = "-"  # the model label of requests for no served model: clients cannot create labels


def find_model(served: dict[str, ServedModel], name: str, version: str | None) -> ServedModel:
    """The served model ``name`` (version 1, or no version given); 404 otherwise."""
    model = served.get(name)
    if model is None:
        raise RequestError(404, f"no model named {name}; this server serves {', '.join(served)}", "unknown_model")
    if version not in (None, "", "1"):
        raise RequestError(404, f"model {name} has no version {version}; it serves version 1", "unknown_model")
    return model


def check_token(metrics, authorization: str | None, token: str | None) -> None:
    """A 401 refusal (counted in /metrics) unless ``authorization`` is ``Bearer <token>``; ``token``
    None: the server asks for none."""
    if token is None or access.authorized(authorization, token):
        return
    metrics.child(metrics.errors, UNKNOWN, "unauthorized").inc()
    raise RequestError(401, access.UNAUTHORIZED, "unauthorized", {"WWW-Authenticate": "Bearer"})


async def infer(batcher, model: ServedModel, parse, connection, timeout_s: float):
    """``(request, output names, outputs)`` of the request ``await parse()`` reads; RequestError for
    every refusal. ``connection``: the client's, when the protocol tells clients apart (batching waits for it)."""
    with batcher.arriving(connection):
        request = await parse()
        names = protocol.check_outputs(request, model.outputs)
        future = batcher.submit(request.inputs, model.check(request.inputs), connection)
    try:
        outputs = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
    except asyncio.TimeoutError:
        raise RequestError(504, f"{model.name} gave no answer within {timeout_s:g} s (--timeout): the server is "
                                "overloaded or the model is slow", "timeout") from None
    return request, names, outputs


def count(metrics, served: dict, name: str, started: float, error: RequestError | None = None) -> None:
    """One answered infer request in /metrics: its status (and reason), and its latency when it succeeded."""
    label = name if name in served else UNKNOWN
    if error is not None:
        metrics.answered(label, error.status, error.reason)
        return
    metrics.answered(label, 200)
    metrics.child(metrics.request_latency, label).observe(time.perf_counter() - started)
