"""What an engine is made of, from TensorRT's engine inspector (needs a GPU it runs on; on a
CPU-only machine ``EngineBuild.plugin_layers`` tells the same from the build)."""

from __future__ import annotations

import json

from deploykit.backends.tensorrt.builder import EngineBuild
from deploykit.backends.tensorrt.loader import deserialize
from deploykit.backends.tensorrt.shim import load_tensorrt

PLUGIN_OPS = ("FusedBatchNorm", "MatMulRelu")


def inspect_engine(engine: EngineBuild | bytes, flavour: str | None = None) -> list[dict]:
    """Layers of an engine from the engine inspector (JSON; details need a DETAILED build)."""
    flv = load_tensorrt(engine.flavour if isinstance(engine, EngineBuild) else flavour)
    data = engine.engine if isinstance(engine, EngineBuild) else engine
    _runtime, deserialized = deserialize(flv, data)
    inspector = deserialized.create_engine_inspector()
    info = json.loads(inspector.get_engine_information(flv.module.LayerInformationFormat.JSON))
    return [layer if isinstance(layer, dict) else {"Name": layer} for layer in info.get("Layers", [])]


def is_plugin_layer(layer: dict) -> bool:
    """Whether an inspector layer dict is one of our plugins."""
    text = json.dumps(layer)
    return "PluginV3" in text or any(op in text for op in PLUGIN_OPS)
