"""``deploykit serve --grpc-port``: the KServe v2 gRPC endpoint (``inference.GRPCInferenceService``),
beside HTTP, in the same process and event loop, over the same batchers.

tritonclient's gRPC client and perf_analyzer speak it, and it spares a request the JSON header:
tensors travel as protobuf bytes (``raw_input_contents``, what tritonclient sends) or typed values
(``contents.fp32_contents``...). The messages and the service's base class are the ones
tritonclient[grpc] generates from the KServe protocol; the RPCs answered here are health,
metadata, config and infer, each checked as HTTP checks it (the same ``requests`` flow, the same
token, the same access line). A refusal is the gRPC status of its HTTP one (400 INVALID_ARGUMENT,
404 NOT_FOUND, 503 UNAVAILABLE...), with the same one line. Outputs always come back raw.

With ``--workers N`` every HTTP worker answers gRPC too, each on the same port (SO_REUSEPORT: the
kernel spreads connections over them); the parent holds a bound, non-listening socket on that port
meanwhile, which picks the port for ``--grpc-port 0`` and keeps other programs off it.
"""

from __future__ import annotations

import functools
import logging
import socket
import time

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from deploykit.errors import EnvironmentProblem
from deploykit.serving import access, protocol, requests
from deploykit.serving.protocol import RequestError, bad
from deploykit.versions import deploykit_version

log = logging.getLogger("deploykit.serve")
SERVICE = "/inference.GRPCInferenceService/"
#: HTTP statuses of refusals and the gRPC status codes that say the same.
STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
                499: grpc.StatusCode.CANCELLED, 503: grpc.StatusCode.UNAVAILABLE,
                504: grpc.StatusCode.DEADLINE_EXCEEDED}
#: Where typed values of each numpy dtype travel in InferTensorContents (fp16 and bf16 have none: raw only).
CONTENTS = {"bool": "bool_contents", "int8": "int_contents", "int16": "int_contents", "int32": "int_contents",
            "int64": "int64_contents", "uint8": "uint_contents", "uint16": "uint_contents",
            "uint32": "uint_contents", "uint64": "uint64_contents", "float32": "fp32_contents",
            "float64": "fp64_contents"}


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT, not listening: the port every gRPC server of
    this ``serve`` then binds (``getsockname()``: the one chosen for port 0). Exit 3 when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    reserved = socket.socket(family, socket.SOCK_STREAM)
    try:
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        reserved.bind((host, port))
    except OSError as error:
        reserved.close()
        raise EnvironmentProblem(f"cannot listen for gRPC on {host}:{port} ({error.strerror or error}): choose "
                                 "another --grpc-port") from None
    return reserved


def address_of(reserved: socket.socket) -> str:
    """host:port of a reserved socket, as gRPC takes it (IPv6 in brackets)."""
    host, port = reserved.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start(address: str, service: InferenceService, max_message_bytes: int) -> grpc.aio.Server:
    """A running gRPC server of ``service`` on ``address`` (reserved by ``reserve_port``)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1), ("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.max_send_message_length", -1)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
    try:
        server.add_insecure_port(address)
    except RuntimeError as error:
        raise EnvironmentProblem(f"cannot listen for gRPC on {address} ({error}): choose another --grpc-port") from None
    await server.start()
    return server


def _rpc(*, open_to_all: bool = False):
    """An RPC's handler: the token checked (unless ``open_to_all``: the health probes), a request id
    in the trailing metadata, a RequestError aborted with its gRPC status, a bug as INTERNAL (logged),
    and one access line."""
    def wrap(method):
        path = SERVICE + method.__name__

        @functools.wraps(method)
        async def handler(self, request, context):
            started, metadata = time.perf_counter(), dict(context.invocation_metadata())
            request_id = access.request_id(metadata.get("x-request-id"))
            context.set_trailing_metadata((("x-request-id", request_id),))
            status = 200
            try:
                if not open_to_all:
                    requests.check_token(self.metrics, metadata.get("authorization"), self.token)
                return await method(self, request, context)
            except RequestError as error:
                status = error.status
                await context.abort(STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL), str(error))
            finally:
                if access.log.isEnabledFor(logging.INFO):
                    access.log_line(method="gRPC", path=path, client=context.peer(), status=status,
                                    request=request_id, started=started, bytes_in=request.ByteSize())
        return handler
    return wrap


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The v2 RPCs over the HTTP app's models, batchers and readiness (``state["ready"]``)."""

    def __init__(self, served: dict, batchers: dict, limits, metrics, state: dict):
        self.served, self.batchers, self.limits, self.metrics, self.state = served, batchers, limits, metrics, state
        self.token = limits.token

    @_rpc(open_to_all=True)
    async def ServerLive(self, request, context):  # noqa: N802 - the protocol's names
        return pb.ServerLiveResponse(live=True)

    @_rpc(open_to_all=True)
    async def ServerReady(self, request, context):  # noqa: N802
        return pb.ServerReadyResponse(ready=self.state["ready"])

    @_rpc()
    async def ServerMetadata(self, request, context):  # noqa: N802
        return pb.ServerMetadataResponse(name="deploykit", version=deploykit_version())

    @_rpc()
    async def ModelReady(self, request, context):  # noqa: N802
        requests.find_model(self.served, request.name, request.version)
        return pb.ModelReadyResponse(ready=self.state["ready"])

    @_rpc()
    async def ModelMetadata(self, request, context):  # noqa: N802
        model = requests.find_model(self.served, request.name, request.version)
        return json_format.ParseDict(model.metadata(), pb.ModelMetadataResponse())

    @_rpc()
    async def ModelConfig(self, request, context):  # noqa: N802
        from deploykit.export.triton import served_config

        model = requests.find_model(self.served, request.name, request.version)
        config = json_format.ParseDict(served_config(model, self.limits.max_delay_ms), model_config_pb2.ModelConfig())
        return pb.ModelConfigResponse(config=config)

    @_rpc()
    async def ModelInfer(self, request, context):  # noqa: N802
        started = time.perf_counter()
        try:
            model = requests.find_model(self.served, request.model_name, request.model_version)

            async def parse() -> protocol.InferRequest:
                return parse_infer(request, model.inputs)

            parsed, names, outputs = await requests.infer(self.batchers[model.name], model, parse, context.peer(),
                                                          self.limits.timeout_s)
            response = encode_response(model.name, parsed, names, outputs)
        except Exception as error:  # noqa: BLE001 - every failure is counted, then answered by _rpc
            if not isinstance(error, RequestError):
                log.exception("gRPC infer request for %s failed", request.model_name)
                error = RequestError(500, "internal server error", "internal")
            requests.count(self.metrics, self.served, request.model_name, started, error)
            raise error from None
        requests.count(self.metrics, self.served, request.model_name, started)
        return response


def parse_infer(request: pb.ModelInferRequest, specs: list[dict]) -> protocol.InferRequest:
    """A ModelInferRequest's inputs as numpy arrays, each checked against ``specs`` as HTTP checks them."""
    if not request.inputs:
        raise bad("the request has no inputs: send one InferInputTensor per model input")
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise bad(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs: send every input "
                  "raw or none")
    wanted = {spec["name"]: spec for spec in specs}
    inputs = {}
    for index, entry in enumerate(request.inputs):
        shape, dtype = protocol.check_input(entry.name, list(entry.shape), entry.datatype, wanted)
        protocol.add_input(inputs, entry.name, _raw_tensor(entry.name, index, raw[index], shape, dtype) if raw
                           else _typed_tensor(entry, shape, dtype))
    outputs = [output.name for output in request.outputs] or None
    return protocol.InferRequest(request.id or None, inputs, outputs, {"*"})


def _raw_tensor(name: str, index: int, raw: bytes, shape: tuple, dtype: np.dtype) -> np.ndarray:
    protocol.check_byte_count(name, f"raw_input_contents[{index}]", len(raw), shape, dtype)
    return protocol.tensor_from_bytes(raw, shape, dtype)


def _typed_tensor(entry, shape: tuple, dtype: np.dtype) -> np.ndarray:
    field = CONTENTS.get(dtype.name)
    count = int(np.prod(shape, dtype=np.int64))
    if field is None and count:
        raise bad(f"input {entry.name} is {entry.datatype}, which has no typed contents: send it in "
                  "raw_input_contents")
    values = np.asarray(getattr(entry.contents, field) if field else [], dtype=dtype if dtype.kind in "bf" else None)
    if values.size != count:
        raise bad(f"input {entry.name} has {values.size} values in contents.{field}, its shape {list(shape)} takes "
                  f"{count}")
    return protocol.exact_cast(entry.name, values.reshape(shape), dtype)


def encode_response(model: str, request: protocol.InferRequest, names: list[str],
                    outputs: dict[str, np.ndarray]) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=model, model_version="1", id=request.id or "")
    for name in names:
        array = outputs[name]
        response.outputs.add(name=name, datatype=protocol.datatype_of_dtype(array.dtype), shape=array.shape)
        response.raw_output_contents.append(protocol.tensor_bytes(array))
    return response
