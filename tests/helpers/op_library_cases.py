"""Hand-built deploykit::FusedBatchNorm / deploykit::MatMulRelu graphs, their inputs and numpy
references, and ONNX Runtime sessions with deploykit's op library and their profiles: the cases
that the op library's tests run on the CPU (tests/native/test_ort_library.py) and on the CUDA
execution provider (tests/gpu/test_ort_cuda.py).
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

TEST_CUDA_ARCHS = "90"
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("deploykit", 1)]
ONNX_TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}

# X shapes of rank 2..5 with odd sizes; the last ones are large enough to be split into chunks
# on ORT's thread pool, with chunk edges inside rows.
BN_SHAPES = [(3, 5), (2, 7, 9), (2, 3, 5, 7), (1, 4, 3, 5, 6), (3, 5, 1, 1), (2, 3, 181, 190), (1, 7, 70001)]
# (A shape, N): A of rank 2 and 3, K and N odd; the last is split by rows on the thread pool.
MATMUL_CASES = [((5, 7), 9), ((2, 3, 7), 9), ((1, 1), 1), ((3, 65, 129), 67)]


# --------------------------------------------------------------------------- graph builders


def model(op: str, inputs: list[str], elem_type: int, attributes: dict | None = None,
          functions: list[onnx.FunctionProto] | None = None) -> bytes:
    """A one-node model `Y = deploykit::op(inputs)` with dynamic shapes."""
    node = helper.make_node(op, inputs, ["Y"], domain="deploykit", **(attributes or {}))
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info(name, elem_type, None) for name in inputs],
        [helper.make_tensor_value_info("Y", elem_type, None)])
    proto = helper.make_model(graph, opset_imports=OPSETS, functions=functions or [])
    proto.ir_version = 10  # readable by every onnxruntime deploykit supports
    return proto.SerializeToString()


def batch_norm_model(dtype=np.float32, activation: str | None = "none", functions=None) -> bytes:
    attributes = {} if activation is None else {"activation": activation}
    return model("FusedBatchNorm", ["X", "scale", "bias"], ONNX_TYPES[dtype], attributes, functions)


def matmul_relu_model(dtype=np.float32, bias: bool = True) -> bytes:
    return model("MatMulRelu", ["A", "B", "bias"] if bias else ["A", "B"], ONNX_TYPES[dtype])


def bfloat16_matmul_relu_model(bias: bool) -> bytes:
    """MatMulRelu on bfloat16 between Casts, so numpy can feed and read float32."""
    inputs = ["A", "B", "bias"] if bias else ["A", "B"]
    casts = [helper.make_node("Cast", [name], [f"{name}_bf16"], to=TensorProto.BFLOAT16) for name in inputs]
    nodes = casts + [
        helper.make_node("MatMulRelu", [f"{name}_bf16" for name in inputs], ["Y_bf16"], domain="deploykit"),
        helper.make_node("Cast", ["Y_bf16"], ["Y"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes, "bf16", [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in inputs],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    proto = helper.make_model(graph, opset_imports=OPSETS)
    proto.ir_version = 10
    return proto.SerializeToString()


def batch_norm_function(rank: int) -> onnx.FunctionProto:
    """The ONNX fallback body of FusedBatchNorm (activation none) for one input rank."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [rank - 1], [-1] + [1] * (rank - 2))
    nodes = [
        helper.make_node("Constant", [], ["shape"], value=shape),
        helper.make_node("Reshape", ["scale", "shape"], ["s"]),
        helper.make_node("Reshape", ["bias", "shape"], ["b"]),
        helper.make_node("Mul", ["X", "s"], ["xs"]),
        helper.make_node("Add", ["xs", "b"], ["Y"]),
    ]
    return helper.make_function("deploykit", "FusedBatchNorm", ["X", "scale", "bias"], ["Y"], nodes,
                                [helper.make_opsetid("", 17)])


# --------------------------------------------------------------------------- inputs and references


def batch_norm_inputs(shape, dtype, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    channels = shape[1]
    return {"X": rng.standard_normal(shape).astype(dtype),
            "scale": rng.uniform(0.5, 2.0, channels).astype(dtype) * rng.choice([-1, 1], channels).astype(dtype),
            "bias": rng.standard_normal(channels).astype(dtype)}


def batch_norm_reference(feeds, activation: str) -> np.ndarray:
    x = feeds["X"].astype(np.float32)
    expand = (-1,) + (1,) * (x.ndim - 2)
    y = x * feeds["scale"].astype(np.float32).reshape(expand) + feeds["bias"].astype(np.float32).reshape(expand)
    return np.maximum(y, 0) if activation == "relu" else y


def matmul_inputs(a_shape, n, dtype, bias: bool, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"A": rng.standard_normal(a_shape).astype(dtype),
             "B": (rng.standard_normal((a_shape[-1], n)) / np.sqrt(a_shape[-1])).astype(dtype)}
    if bias:
        feeds["bias"] = rng.standard_normal(n).astype(dtype)
    return feeds


def matmul_reference(feeds) -> np.ndarray:
    y = feeds["A"].astype(np.float32) @ feeds["B"].astype(np.float32)
    if "bias" in feeds:
        y = y + feeds["bias"].astype(np.float32)
    return np.maximum(y, 0)


def round_to_bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded (to nearest even) to what bfloat16 can hold."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def tolerance(dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == np.float32 else {"rtol": 5e-3, "atol": 5e-3}


# --------------------------------------------------------------------------- sessions and profiles

_profile_ids = itertools.count()


def session(model_bytes: bytes, library: Path | None, providers=("CPUExecutionProvider",),
            profile: bool = False, threads: int = 2) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = f"deploykit_profile_{os.getpid()}_{next(_profile_ids)}"
    if library is not None:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model_bytes, options, providers=list(providers))


def profiled_nodes(sess: ort.InferenceSession) -> list[dict]:
    """op_name, provider and input element types of every node ORT ran, from its profile."""
    path = Path(sess.end_profiling())
    try:
        events = json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)
    return [{"op": e["args"]["op_name"], "provider": e["args"]["provider"],
             "types": [next(iter(shape)) for shape in e["args"].get("input_type_shape", [])]}
            for e in events if e.get("cat") == "Node" and "op_name" in e.get("args", {})]


def profile_cases(dtype) -> list[tuple[str, bytes, dict[str, np.ndarray]]]:
    """One model per op, with feeds, for checking which kernel ORT ran."""
    return [("FusedBatchNorm", batch_norm_model(dtype, "relu"), batch_norm_inputs((2, 3, 4, 5), dtype)),
            ("MatMulRelu", matmul_relu_model(dtype), matmul_inputs((2, 4, 6), 3, dtype, True))]
