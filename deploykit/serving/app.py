"""The HTTP side: the v2 routes over the models' batchers, auth, limits and the access log.

Every refusal is a ``{"error": "..."}`` body with its status; nothing a client sends reaches a
traceback. Model names in metric labels are only the served ones, so a client cannot grow them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import importlib.metadata
import json
import logging
import re
import time
import uuid
import zlib

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from deploykit.serving import protocol
from deploykit.serving.batching import Batcher
from deploykit.serving.metrics import Metrics
from deploykit.serving.models import ServedModel
from deploykit.serving.protocol import RequestError

access_log = logging.getLogger("deploykit.serve.access")
#: Paths answered without a token: orchestrators probe them without credentials.
OPEN_PATHS = ("/v2/health/live", "/v2/health/ready")
UNKNOWN = "-"  # the model label of requests for no served model
#: A client's X-Request-ID echoed back and logged only when it is a plain token.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclasses.dataclass
class Limits:
    """What one request may ask of the server (the CLI's options)."""

    max_request_bytes: int = 64 << 20
    max_queue: int = 256
    timeout_s: float = 30.0
    max_delay_ms: float = 2.0
    token: str | None = None


def create_app(models: list[ServedModel], limits: Limits) -> FastAPI:
    """The app; batchers start with it and, at shutdown, finish every queued request before they stop."""
    metrics = Metrics()
    served = {model.name: model for model in models}
    batchers: dict[str, Batcher] = {}
    state = {"ready": False}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        for model in models:
            batchers[model.name] = Batcher(model, limits.max_delay_ms / 1e3, limits.max_queue, metrics)

        async def ready_once_warm():  # requests are queued meanwhile; only readiness waits
            await asyncio.gather(*(asyncio.to_thread(b.wait_warm) for b in batchers.values()))
            state["ready"] = True

        warming = asyncio.create_task(ready_once_warm())
        yield
        warming.cancel()
        state["ready"] = False
        await asyncio.gather(*(asyncio.to_thread(b.close) for b in batchers.values()))
        for model in models:
            for runner in model.runners:
                runner.close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestError)
    async def refused(_request, error: RequestError):
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(_request, error: HTTPException):
        return error_response(RequestError(error.status_code, str(error.detail), "http"))

    app.add_middleware(AuthAndAccessLog, token=limits.token, metrics=metrics)

    def model_for(name: str, version: str | None) -> ServedModel:
        model = served.get(name)
        if model is None:
            raise RequestError(404, f"no model named {name}; this server serves {', '.join(served)}", "unknown_model")
        if version not in (None, "1"):
            raise RequestError(404, f"model {name} has no version {version}; it serves version 1", "unknown_model")
        return model

    @app.get("/v2")
    async def server_metadata():
        return {"name": "deploykit", "version": importlib.metadata.version("deploykit"),
                "extensions": ["binary_tensor_data"]}

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        if not state["ready"]:
            raise RequestError(503, "the server is starting or shutting down", "not_ready")
        return {"ready": True}

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def model_metadata(name: str, version: str | None = None):
        return model_for(name, version).metadata()

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(name: str, version: str | None = None):
        model_for(name, version)
        if not state["ready"]:
            raise RequestError(503, f"{name} is not ready: the server is starting or shutting down", "not_ready")
        return {"name": name, "ready": True}

    @app.get("/v2/models/{name}/config")
    @app.get("/v2/models/{name}/versions/{version}/config")
    async def model_config(name: str, version: str | None = None):
        from deploykit.export.triton import served_config

        return served_config(model_for(name, version), limits.max_delay_ms)

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str | None = None):
        label = name if name in served else UNKNOWN
        started = time.perf_counter()
        try:
            model = model_for(name, version)
            body, header_length = await _infer(model, request)
        except RequestError as error:
            metrics.answered(label, error.status, error.reason)
            return error_response(error)
        metrics.answered(label, 200)
        metrics.request_latency.labels(label).observe(time.perf_counter() - started)
        if header_length is None:
            return Response(body, media_type="application/json")
        return Response(body, media_type="application/octet-stream",
                        headers={protocol.HEADER_LENGTH: str(header_length)})

    async def _infer(model: ServedModel, request: Request) -> tuple[bytes, int | None]:
        body = await read_body(request, limits.max_request_bytes)
        parsed = protocol.parse_infer(body, request.headers.get(protocol.HEADER_LENGTH.lower()), model.inputs)
        names = protocol.check_outputs(parsed, model.outputs)
        rows = model.check(parsed.inputs)
        future = batchers[model.name].submit(parsed.inputs, rows)
        try:
            outputs = await asyncio.wait_for(asyncio.wrap_future(future), limits.timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(504, f"{model.name} gave no answer within {limits.timeout_s:g} s (--timeout): the "
                                    "server is overloaded or the model is slow", "timeout") from None
        return protocol.encode_response(model.name, parsed, names, outputs)

    @app.get("/metrics")
    async def prometheus_metrics():
        text, content_type = metrics.render()
        return Response(text, media_type=content_type)

    app.state.metrics = metrics
    return app


class AuthAndAccessLog:
    """ASGI middleware: the bearer token checked (health probes excepted), a request id on every
    response (the client's X-Request-ID when it is a plain token, else a new one), one log line."""

    def __init__(self, app, token: str | None, metrics: Metrics):
        self.app, self.token, self.metrics = app, token, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, headers = time.perf_counter(), Headers(scope=scope)
        given = headers.get("x-request-id", "")
        request_id = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex[:16]

        async def send_with_id(message):
            if message["type"] == "http.response.start":  # logged before the client can see the answer
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                _log_access(scope, headers, message["status"], request_id, started)
            await send(message)

        if self.token is not None and scope["path"] not in OPEN_PATHS and not _authorized(headers, self.token):
            self.metrics.errors.labels(UNKNOWN, "unauthorized").inc()
            refusal = RequestError(401, "missing or wrong bearer token: send the header 'Authorization: Bearer "
                                        "<token>'", "unauthorized", {"WWW-Authenticate": "Bearer"})
            await error_response(refusal)(scope, receive, send_with_id)
        else:
            await self.app(scope, receive, send_with_id)


def error_response(error: RequestError) -> JSONResponse:
    return JSONResponse({"error": str(error)}, status_code=error.status, headers=error.headers)


def _authorized(headers: Headers, token: str) -> bool:
    scheme, _, given = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def read_body(request: Request, limit: int) -> bytes:
    """The body, decompressed where the client says so, refused (413) as soon as it passes ``limit``."""
    too_large = RequestError(413, f"the request is larger than {limit} bytes (--max-request-mb): send fewer "
                                  "rows per request", "too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return _decompressed(b"".join(chunks), request.headers.get("content-encoding"), limit, too_large)


def _decompressed(body: bytes, encoding: str | None, limit: int, too_large: RequestError) -> bytes:
    if encoding in (None, "", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise RequestError(415, f"Content-Encoding {encoding} is not supported: send gzip, deflate or none")
    inflater = zlib.decompressobj(31 if encoding == "gzip" else 15)
    try:
        plain = inflater.decompress(body, limit + 1)
    except zlib.error as error:
        raise protocol.bad(f"the body is not valid {encoding} ({error})") from None
    if len(plain) > limit or inflater.unconsumed_tail:
        raise too_large
    return plain


def _log_access(scope, headers: Headers, status: int, request_id: str, started: float) -> None:
    """One JSON line per request: what a log pipeline indexes without parsing free text."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    client, length = scope.get("client"), headers.get("content-length", "")
    access_log.info(json.dumps({
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "request_id": request_id,
        "client": f"{client[0]}:{client[1]}" if client else None, "method": scope["method"],
        "path": scope["path"], "status": status, "ms": round((time.perf_counter() - started) * 1e3, 3),
        "bytes_in": int(length) if length.isdigit() else 0,
    }))
