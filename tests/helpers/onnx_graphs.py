"""Small hand-built ONNX graphs for pass tests, and running them in ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

EPS = 1e-3


def tensor(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)


def batch_norm(rng, x: str, y: str, channels: int, name: str = "bn"):
    """A BatchNormalization node ``x -> y`` and its random (gamma, beta, mean, var) initializers."""
    params = {
        "gamma": rng.uniform(0.5, 2.0, channels),
        "beta": rng.normal(size=channels),
        "mean": rng.normal(size=channels),
        "var": rng.uniform(0.5, 2.0, channels),
    }
    names = [f"{name}.{key}" for key in params]
    node = helper.make_node("BatchNormalization", [x, *names], [y], name=name, epsilon=EPS)
    return node, [tensor(n, v) for n, v in zip(names, params.values())]


def output(name: str, rank: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N"] + [None] * (rank - 1))


def make_model(nodes, initializers, inputs: dict[str, list], outputs: dict[str, int]) -> onnx.ModelProto:
    """A model from ``inputs`` (name -> shape) to ``outputs`` (name -> rank)."""
    graph = helper.make_graph(
        nodes,
        "pass_test",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n, shape in inputs.items()],
        [output(n, rank) for n, rank in outputs.items()],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    # Keep ORT from fusing Conv+BN itself: the reference must be the unfolded computation.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)
