"""The v2 wire format without a server: binary and JSON tensors of the dtypes bundles declare,
exact integer casts, and responses that tritonclient's own parser reads back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deploykit.serving import protocol
from deploykit.backends.base.feeds import numpy_dtype
from deploykit.serving.protocol import RequestError

SPECS = [{"name": "ids", "dtype": "int64", "shape": ["batch", 3]},
         {"name": "x", "dtype": "bfloat16", "shape": ["batch", 2]}]


def binary_request(arrays: dict[str, np.ndarray], datatypes: dict[str, str]) -> tuple[bytes, str]:
    header = json.dumps({"inputs": [{"name": n, "shape": list(a.shape), "datatype": datatypes[n],
                                     "parameters": {"binary_data_size": a.nbytes}} for n, a in arrays.items()]})
    return header.encode() + b"".join(a.tobytes() for a in arrays.values()), str(len(header))


def test_binary_int64_and_bfloat16():
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    x = np.array([[1.5, -2], [0.25, 3]], dtype=numpy_dtype("bfloat16"))
    body, length = binary_request({"ids": ids, "x": x}, {"ids": "INT64", "x": "BF16"})
    parsed = protocol.parse_infer(body, length, SPECS)
    np.testing.assert_array_equal(parsed.inputs["ids"], ids)
    assert parsed.inputs["x"].dtype == x.dtype and parsed.inputs["x"].tolist() == x.tolist()


def test_json_integers_must_be_exact():
    request = {"inputs": [{"name": "ids", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 3.5]}]}
    with pytest.raises(RequestError, match="not representable as INT64"):
        protocol.parse_infer(json.dumps(request).encode(), None, SPECS)
    request["inputs"][0]["data"] = [[1, 2, 3]]  # nested lists are read as the shape says
    assert protocol.parse_infer(json.dumps(request).encode(), None, SPECS).inputs["ids"].tolist() == [[1, 2, 3]]


def test_binary_sizes_and_repeated_inputs_are_refused():
    ids = np.arange(3, dtype=np.int64).reshape(1, 3)
    header = {"inputs": [{"name": "ids", "shape": [1, 3], "datatype": "INT64", "parameters": {"binary_data_size": 23}}]}
    text = json.dumps(header)
    with pytest.raises(RequestError, match="binary_data_size is 23 bytes, its shape and datatype take 24"):
        protocol.parse_infer(text.encode() + ids.tobytes(), str(len(text)), SPECS)
    twice = {"inputs": [{"name": "ids", "shape": [1, 3], "datatype": "INT64", "data": [1, 2, 3]}] * 2}
    with pytest.raises(RequestError, match="input ids is given twice"):
        protocol.parse_infer(json.dumps(twice).encode(), None, SPECS)


def test_response_read_by_tritonclient():
    tritonhttp = pytest.importorskip("tritonclient.http")
    request = protocol.InferRequest("7", {}, ["a", "b"], {"b"})
    outputs = {"a": np.array([[1.25, 2]], np.float32), "b": np.array([[3, 4]], np.int64)}
    body, header_length = protocol.encode_response("m", request, ["a", "b"], outputs)
    result = tritonhttp.InferResult.from_response_body(body, header_length=header_length)
    np.testing.assert_array_equal(result.as_numpy("a"), outputs["a"])
    np.testing.assert_array_equal(result.as_numpy("b"), outputs["b"])
    assert result.get_response()["id"] == "7"
