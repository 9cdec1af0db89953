"""Whether an engine can run here: engines run only on the TensorRT version and the GPUs they
were built for. One pure rule, for ``load``, doctor, the conversion's engine stage and the runner.
"""

from __future__ import annotations

from typing import Mapping

from deploykit.backends.tensorrt import shim

TRT_PIP = {"tensorrt": "tensorrt=={v}", "tensorrt-rtx": "tensorrt-rtx-cu13-libs=={v} tensorrt-rtx-cu13-bindings=={v}"}


def engine_problem(engine: Mapping, installed: tuple[str | None, tuple[str, ...] | None], gpus) -> str | None:
    """Why this machine cannot run an engine (None: it can). Pure, for doctor and tests.

    ``engine`` holds its "flavour", "version" and "targets" (a bundle's engine entry; without
    "targets", any engine of that TensorRT), and maybe "skipped_targets", the ones TensorRT refused; ``installed`` is ``shim.installed_tensorrt(flavour)``;
    ``gpus`` is ``shim.local_gpus()``: ((name, "major.minor"), ...) or the reason there is no GPU.
    """
    flavour, built = engine["flavour"], engine["version"]
    label = "TensorRT-RTX" if flavour == "tensorrt-rtx" else "TensorRT"
    version, rtx_targets = installed
    install = TRT_PIP[flavour].format(v=built)
    if version is None:
        return f"{label} is not installed: pip install {install}"
    if version != built:
        return (f"it was built with {label} {built} and this machine has {version}; engines run on the version "
                f"that built them: pip install {install}, or re-run deploykit convert --backend tensorrt here")
    if isinstance(gpus, str) or not gpus:
        return f"{label} engines need an NVIDIA GPU and {gpus or 'there is none'}"
    name, capability = gpus[0]
    if rtx_targets is not None and capability not in rtx_targets:
        return (f"{label} does not run on compute capability {capability} ({name}); it supports "
                f"{', '.join(rtx_targets)}: install full TensorRT (pip install tensorrt) and convert with it here")
    targets = engine.get("targets")
    skipped = next((s for s in engine.get("skipped_targets") or [] if s.get("target") == capability), None)
    if skipped:
        layer = f"layer {skipped['layer']}" if skipped.get("layer") else "a layer"
        return (f"the engine was not built for compute capability {capability} ({name}), TensorRT refused "
                f"{layer} there ({skipped['reason']}): convert with --precision fp16 --trt-targets {capability}")
    if targets is not None and capability not in targets:
        return (f"the engine was built for compute capability {', '.join(targets)} and this "
                f"{name} is {capability}: convert with --trt-targets {capability}")
    return None


def engine_problem_here(engine: Mapping) -> str | None:
    """``engine_problem`` against this machine's TensorRT and GPUs."""
    return engine_problem(engine, shim.installed_tensorrt(engine["flavour"]), shim.local_gpus())
