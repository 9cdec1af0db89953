"""Whether a file a bundle uses stays inside the bundle: through symlinks, and through the external
data an ONNX graph points to (which ONNX Runtime and ``onnx.load`` would read from anywhere)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from deploykit.errors import BadInputError


def inside(path: Path, folder: Path) -> bool:
    """Whether ``path``, its symlinks followed, lies in ``folder``."""
    return path.resolve().is_relative_to(folder.resolve())


def external_data_outside(model: Path, folder: Path) -> Path | None:
    """The first external-data file of the graph at ``model`` that lies outside ``folder``, if any;
    read from the graph's tensor records only, the data itself is not loaded."""
    try:
        graph = onnx.load(model, load_external_data=False)
    except DecodeError as error:
        raise BadInputError(f"{model} is not an ONNX graph ({error}); restore it or re-run deploykit convert") from None
    for tensor in _tensors(graph.graph, graph.functions):
        if uses_external_data(tensor):
            location = model.parent / ExternalDataInfo(tensor).location  # an absolute location replaces the folder
            if not inside(location, folder):
                return location
    return None


def _tensors(graph: onnx.GraphProto, functions=()) -> Iterator[onnx.TensorProto]:
    """Every tensor of a graph: initializers, sparse ones, and node attributes down through subgraphs."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    nodes = [*graph.node, *(node for function in functions for node in function.node)]
    for node in nodes:
        for attribute in node.attribute:
            yield from ([attribute.t] if attribute.HasField("t") else attribute.tensors)
            for subgraph in ([attribute.g] if attribute.HasField("g") else attribute.graphs):
                yield from _tensors(subgraph)
