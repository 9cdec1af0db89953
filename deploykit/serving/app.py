"""The HTTP side: the v2 routes over the models' batchers, auth, limits and the access log.

Every refusal is a ``{"error": "..."}`` body with its status; nothing a client sends reaches a
traceback. Model names in metric labels are only the served ones, so a client cannot grow them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
import zlib
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from deploykit.errors import EnvironmentProblem
from deploykit.serving import access, protocol, requests
from deploykit.serving.batching import Batcher
from deploykit.serving.metrics import Metrics
from deploykit.serving.models import ServedModel
from deploykit.serving.protocol import RequestError
from deploykit.versions import deploykit_version

#: Paths answered without a token: orchestrators probe them without credentials.
OPEN_PATHS = ("/v2/health/live", "/v2/health/ready")


@dataclasses.dataclass
class Limits:
    """What one request may ask of the server (the CLI's options)."""

    max_request_bytes: int = 64 << 20
    max_queue: int = 256
    timeout_s: float = 30.0
    max_delay_ms: float = 2.0
    token: str | None = None


def create_app(models: list[ServedModel], limits: Limits, on_ready, batcher_for, grpc_address: str | None = None,
               on_failed=None):
    """The app (an ASGI callable); batchers start with it and, at shutdown, finish every queued request
    before they stop; ``on_ready()`` once every runner is warm. ``batcher_for(model, metrics)``: where
    a model's requests go (a Batcher over its runners in this process, or the model process's).
    ``grpc_address``: also answer gRPC there, over the same batchers (``grpc_service``); where that
    server cannot start, ``on_failed(message)`` instead of ``on_ready``."""
    metrics = Metrics()
    served = {model.name: model for model in models}
    batchers: dict[str, Batcher] = {}
    state = {"ready": False}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        for model in models:
            batchers[model.name] = batcher_for(model, metrics)
        grpc_server = None
        if grpc_address is not None:
            from deploykit.serving import grpc_service

            service = grpc_service.InferenceService(served, batchers, limits, metrics, state)
            try:
                grpc_server = await grpc_service.start(grpc_address, service, limits.max_request_bytes)
            except EnvironmentProblem as problem:
                on_failed(str(problem))

        async def ready_once_warm():  # requests are queued meanwhile; only readiness waits
            await asyncio.gather(*(asyncio.to_thread(b.wait_warm) for b in batchers.values()))
            state["ready"] = True
            if on_ready is not None:
                on_ready()

        warming = asyncio.create_task(ready_once_warm()) if grpc_address is None or grpc_server else None
        yield
        if warming is not None:
            warming.cancel()
        state["ready"] = False
        if grpc_server is not None:  # stops taking RPCs, answers those in flight
            await grpc_server.stop(limits.timeout_s + 1)
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

    def model_for(name: str, version: str | None) -> ServedModel:
        return requests.find_model(served, name, version)

    @app.get("/v2")
    async def server_metadata():
        return {"name": "deploykit", "version": deploykit_version(),
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

    @app.get("/metrics")
    async def prometheus_metrics():
        text, content_type = metrics.render()
        return Response(text, media_type=content_type)

    infer = InferRoute(app, served, batchers, limits, metrics)
    return AuthAndAccessLog(infer, token=limits.token, metrics=metrics)


#: The infer paths, with the model's name and (optionally) its version.
INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


class InferRoute:
    """ASGI: infer requests are answered here, every other request by the FastAPI app behind.

    Infer is the one hot path (thousands a second, each a large body): FastAPI's routing,
    exception and dependency layers cost more per request than reading and parsing it, so it
    goes straight from ASGI's receive to the batcher and back to send.
    """

    def __init__(self, app: FastAPI, served: dict[str, ServedModel], batchers: dict[str, Batcher], limits: Limits,
                 metrics: Metrics):
        self.app, self.served, self.batchers, self.limits, self.metrics = app, served, batchers, limits, metrics

    async def __call__(self, scope, receive, send):
        match = INFER_PATH.fullmatch(scope["path"]) if scope["type"] == "http" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "POST":
            status, headers, body = await self.answer(match[1], match[2], scope, receive)
        else:
            refusal = RequestError(405, f"{scope['path']} takes POST", "method", {"Allow": "POST"})
            status, headers, body = refusal.status, _json_headers(refusal.headers), _error_body(refusal)
        headers.append((b"content-length", str(len(body)).encode()))  # else uvicorn sends the body chunked
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def answer(self, name: str, version: str | None, scope, receive) -> tuple[int, list, bytes]:
        """(status, headers, body) of one infer request; every refusal is a RequestError's JSON."""
        started = time.perf_counter()
        try:
            model = requests.find_model(self.served, name, version)
            body, header_length = await self.infer(model, request_headers(scope), receive, scope.get("client"))
        except RequestError as error:
            requests.count(self.metrics, self.served, name, started, error)
            return error.status, _json_headers(error.headers), _error_body(error)
        except Exception:  # noqa: BLE001 - a bug answers 500 and is logged; the server stays up
            logging.getLogger("deploykit.serve").exception("infer request for %s failed", name)
            error = RequestError(500, "internal server error", "internal")
            requests.count(self.metrics, self.served, name, started, error)
            return 500, _json_headers(), _error_body(error)
        requests.count(self.metrics, self.served, name, started)
        if header_length is None:
            return 200, _json_headers(), body
        return 200, [(b"content-type", b"application/octet-stream"),
                     (protocol.HEADER_LENGTH.lower().encode(), str(header_length).encode())], body

    async def infer(self, model: ServedModel, headers: dict[str, str], receive, connection) -> tuple[bytes, int | None]:
        batcher, header_length = self.batchers[model.name], headers.get(protocol.HEADER_LENGTH.lower())
        with _body_buffer(batcher, headers, self.limits.max_request_bytes) as into:
            async def parse() -> protocol.InferRequest:
                body = await read_body(receive, headers, self.limits.max_request_bytes, into)
                return protocol.parse_infer(body, header_length, model.inputs)

            request, names, outputs = await requests.infer(batcher, model, parse, connection, self.limits.timeout_s)
        return protocol.encode_response(model.name, request, names, outputs)


def _body_buffer(batcher, headers: dict[str, str], limit: int):
    """The batcher's buffer for a body of binary tensors (``serve --workers``: shared memory, which the
    tensors are then read from where they lie), where its length is declared and it is not compressed;
    else a context of None (the body is read into memory of its own)."""
    size, header_length = headers.get("content-length", ""), headers.get(protocol.HEADER_LENGTH.lower(), "")
    if (not size.isdigit() or not header_length.isdigit() or not 0 < int(header_length) <= int(size) <= limit
            or headers.get("content-encoding", "identity") != "identity"):
        return contextlib.nullcontext()
    return batcher.body_buffer(int(size), int(header_length))


def _json_headers(extra: dict | None = None) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"),
            *((key.lower().encode(), str(value).encode()) for key, value in (extra or {}).items())]


def _error_body(error: RequestError) -> bytes:
    return json.dumps({"error": str(error)}).encode()


class AuthAndAccessLog:
    """ASGI middleware: the bearer token checked (health probes excepted), a request id on every
    response (the client's X-Request-ID when it is a plain token, else a new one), one log line."""

    def __init__(self, app, token: str | None, metrics: Metrics):
        self.app, self.token, self.metrics = app, token, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, headers = time.perf_counter(), request_headers(scope)
        request_id = access.request_id(headers.get("x-request-id"))

        async def send_with_id(message):
            if message["type"] == "http.response.start":  # logged before the client can see the answer
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                _log_access(scope, headers, message["status"], request_id, started)
            await send(message)

        try:
            if scope["path"] not in OPEN_PATHS:
                requests.check_token(self.metrics, headers.get("authorization"), self.token)
        except RequestError as refusal:
            await error_response(refusal)(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)


def request_headers(scope) -> dict[str, str]:
    """The request's headers by name (ASGI lowercases names), the first of a repeated one: read once
    per request, where Starlette's ``Headers`` scans every header again on each lookup."""
    found: dict[str, str] = {}
    for name, value in scope["headers"]:
        found.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return found


def error_response(error: RequestError) -> JSONResponse:
    return JSONResponse({"error": str(error)}, status_code=error.status, headers=error.headers)


async def read_body(receive, headers: dict[str, str], limit: int, into: memoryview | None = None) -> bytes | memoryview:
    """The body, decompressed where the client says so, refused (413) as soon as it passes ``limit``;
    ``into``: a view of the body's declared length to read it into (``_body_buffer``), which is returned."""
    def too_large():
        return RequestError(413, f"the request is larger than {limit} bytes (--max-request-mb): send fewer "
                                 "rows per request", "too_large")

    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large()
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RequestError(499, "the client closed the connection before its request arrived", "disconnected")
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            raise too_large()
        if into is None:
            chunks.append(chunk)
        elif size <= len(into):
            into[size - len(chunk):size] = chunk
    if into is not None:
        if size != len(into):
            raise protocol.bad(f"the body has {size} bytes where its Content-Length says {len(into)}")
        return into
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return _decompressed(body, headers.get("content-encoding"), limit, too_large)


def _decompressed(body: bytes, encoding: str | None, limit: int, too_large: Callable[[], RequestError]) -> bytes:
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
        raise too_large()
    return plain


def _log_access(scope, headers: dict[str, str], status: int, request_id: str, started: float) -> None:
    client, length = scope.get("client"), headers.get("content-length", "")
    access.log_line(method=scope["method"], path=scope["path"], client=f"{client[0]}:{client[1]}" if client else None,
                    status=status, request=request_id, started=started, bytes_in=int(length) if length.isdigit() else 0)
