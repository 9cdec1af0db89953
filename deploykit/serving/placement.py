"""Where a model's instances run: the ``--device`` values as one device per instance.

``cuda`` is every GPU this process sees (``CUDA_VISIBLE_DEVICES`` applies), ``cuda:K`` one of
them, and a comma list (or the option repeated) several; instance i runs on the i-th device mod
their count, so ``--device cuda --instances 4`` on two GPUs puts two on each. ``auto`` is what
``deploykit.load`` picks (GPU 0, else the CPU).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from deploykit.errors import BadInputError, EnvironmentProblem
from deploykit.bundle.read import Bundle
from deploykit.runtime.choose import auto_device, parse_device


MAX_AUTO_WORKERS = 8


def usable_cores() -> int:
    """The cores this process may use: its affinity (taskset, cpusets) and its cgroup's CPU quota
    (``docker run --cpus``, a Kubernetes CPU limit), which the affinity does not show (joblib reads both)."""
    import joblib

    return joblib.cpu_count()


def auto_workers(devices: Sequence[str], backend: str = "auto", bundles: Iterable[Bundle] = (),
                 trust_native: bool = False) -> int:
    """``serve --workers auto``: where the models run on a GPU (``--device cuda...``, or ``auto`` where
    ``deploykit.load`` would put one of ``bundles`` on a GPU), HTTP processes for half the cores, at most 8:
    one process parses and encodes requests far slower than a GPU answers them (BENCHMARKS.md, issue 25:
    BERT-base at 128 connections about 2,000/s in one process, 7,000 to 8,850/s with 8 workers on 16-core
    H100 hosts). On a CPU one process: the model's runs need every core, and a second process only takes
    cores from them."""
    kinds = {parse_device(device)[0] for device in _listed(devices)}
    if kinds == {"auto"}:
        on_gpu = any(auto_device(bundle, backend, trust_native) == "cuda" for bundle in bundles)
    else:
        on_gpu = "cuda" in kinds and backend != "openvino"
    return max(1, min(MAX_AUTO_WORKERS, usable_cores() // 2)) if on_gpu else 1


def visible_gpus() -> int:
    """How many GPUs the driver shows this process (0 without one)."""
    from deploykit.backends.tensorrt.shim import local_gpus

    gpus = local_gpus()
    return 0 if isinstance(gpus, str) else len(gpus)


def instance_devices(devices: Sequence[str], instances: int) -> list[str]:
    """The device of each instance, round-robin over ``devices`` with ``cuda`` expanded to every GPU."""
    listed = _listed(devices)
    kinds = {parse_device(device)[0] for device in listed}
    if len(kinds) > 1:
        raise BadInputError(f"--device {','.join(listed)}: a model's instances all run on the CPU or all on GPUs "
                            "(or all auto); serve the other kind from a second server")
    expanded = _gpus(listed) if kinds == {"cuda"} else listed
    return [expanded[i % len(expanded)] for i in range(instances)]


def _listed(devices: Sequence[str]) -> list[str]:
    """The ``--device`` values, each a device or a comma list of them, as one list."""
    return [part.strip() for value in devices for part in value.split(",")]


def _gpus(listed: list[str]) -> list[str]:
    """``cuda`` as every GPU seen; a ``cuda:K`` beyond them refused before any runner loads."""
    count = visible_gpus()
    if count == 0:
        raise EnvironmentProblem(f"--device {','.join(listed)}: no GPU is visible here (check nvidia-smi and "
                                 "CUDA_VISIBLE_DEVICES), or serve with --device cpu")
    expanded = []
    for device in listed:
        if device == "cuda":
            expanded += [f"cuda:{index}" for index in range(count)]
        elif parse_device(device)[1] >= count:
            raise BadInputError(f"--device {device}: this process sees {count} GPU(s), cuda:0..cuda:{count - 1} "
                                "(CUDA_VISIBLE_DEVICES renumbers them from 0)")
        else:
            expanded.append(device)
    return expanded
