"""``deploykit export triton``: a bundle as a Triton Inference Server model repository.

``REPO/NAME/config.pbtxt`` and ``REPO/NAME/1/model.onnx`` (platform ``onnxruntime_onnx``, our op
library beside it under ``model_operations``), ``REPO/NAME/1/model.plan`` (``tensorrt_plan``,
our plugin library beside it, loaded with ``--backend-config=tensorrt,plugins=...``) or
``REPO/NAME/1/model.py`` and the bundle in ``1/bundle`` (``backend: "python"``: deploykit itself
runs the bundle in Triton's python backend, serving.triton_model, so every backend we have is
served), and a README with the versions or the Python that Triton must bring. The config is
written from the same description ``deploykit serve`` answers ``/v2/models/NAME/config`` with,
so both speak of a model alike.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from deploykit.bundle import trust
from deploykit.bundle.format import MANIFEST, sha256_of
from deploykit.bundle.read import Bundle, check_validation, open_bundle
from deploykit.backends.onnxruntime.loader import MIN_ORT_FOR_OP_LIBRARY
from deploykit.errors import BadInputError, EnvironmentProblem
from deploykit.serving.models import batch_range
from deploykit.serving.protocol import datatype_of

PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "tensorrt": "tensorrt_plan", "python": "python"}
#: what Triton names by its backend (``backend: "python"``) rather than by a platform
BACKENDS = {"python"}
#: the python platform's 1/model.py: deploykit's model class, so Triton serves deploykit's tested code
MODEL_PY = "# Written by deploykit export triton: the model is deploykit's, run from the bundle beside this file.\n" \
           "from deploykit.serving.triton_model import TritonPythonModel  # noqa: F401\n"


class Enum(str):
    """A protobuf enum value: written bare in text format (TYPE_FP32), as a string in JSON."""


def tensor_configs(specs: list[dict], batched: bool) -> list[dict]:
    """Triton's ModelInput/ModelOutput: dims without the batch dimension when Triton batches."""
    configs = []
    for spec in specs:
        dims = [d if isinstance(d, int) and d > 0 else -1 for d in spec["shape"]]
        configs.append({"name": spec["name"], "data_type": Enum(f"TYPE_{datatype_of(spec['dtype'])}"),
                        "dims": dims[1:] if batched else dims})
    return configs


def model_config(name: str, platform: str, inputs: list[dict], outputs: list[dict], max_batch: int,
                 preferred: list[int], max_delay_ms: float, instances: int, gpus: list[int] | None) -> dict:
    """A ModelConfig as a dict of its protobuf field names (max_batch 0: Triton does not batch);
    ``gpus``: the GPU of each instance, None on the CPU."""
    config = {"name": name, "backend" if platform in BACKENDS else "platform": platform, "max_batch_size": max_batch,
              "input": tensor_configs(inputs, max_batch > 0), "output": tensor_configs(outputs, max_batch > 0)}
    if max_batch > 0:
        config["dynamic_batching"] = {**({"preferred_batch_size": preferred} if preferred else {}),
                                      "max_queue_delay_microseconds": round(max_delay_ms * 1000)}
    config["instance_group"] = instance_groups(instances, gpus)
    return config


def model_warmup(inputs: list[dict], sizes: list[int], runs: int, batched: bool, random: bool = True) -> list[dict]:
    """Triton's model_warmup: ``runs`` requests at each batch size before the model is ready, as
    serve's --warmup-runs; float inputs random, others zeros (token ids must stay in range). Empty
    where a dimension other than the batch is not fixed, as its data would have no size.
    ``random=False``: zeros everywhere. Triton's random data is random bytes, floats among them
    NaN or infinite, which the python model refuses as serve does; Triton ignores a refused
    warm-up request, so the run it was meant to warm would never happen."""
    configs = tensor_configs(inputs, batched)
    if runs == 0 or any(d < 0 for config in configs for d in config["dims"]):
        return []

    def data(spec: dict, config: dict) -> dict:
        fill = "random_data" if random and spec["dtype"].startswith(("float", "bfloat")) else "zero_data"
        return {"key": spec["name"], "value": {"data_type": config["data_type"], "dims": config["dims"], fill: True}}

    samples = [data(spec, config) for spec, config in zip(inputs, configs)]
    return [{"name": f"batch_{size}", "batch_size": size, "count": runs, "inputs": samples} for size in sizes]


def instance_groups(instances: int, gpus: list[int] | None) -> list[dict]:
    """Triton's instance_group, whose ``count`` is per listed GPU: GPUs that hold as many instances
    share a group (two on cuda:0 and one on cuda:1 are two groups)."""
    if gpus is None:
        return [{"count": instances, "kind": Enum("KIND_CPU")}]
    alike: dict[int, list[int]] = {}
    for gpu in sorted(set(gpus)):
        alike.setdefault(gpus.count(gpu), []).append(gpu)
    return [{"count": count, "kind": Enum("KIND_GPU"), "gpus": listed} for count, listed in alike.items()]


def served_config(model, max_delay_ms: float) -> dict:
    """What ``deploykit serve`` answers for ``/v2/models/NAME/config`` (a ServedModel)."""
    max_batch = model.max_batch if model.batching else 0
    return model_config(model.name, f"deploykit_{model.runner.backend}", model.inputs, model.outputs, max_batch,
                        model.buckets, max_delay_ms, len(model.runners), model.gpus)


def to_pbtxt(message: dict, indent: int = 0) -> str:
    """Protobuf text format of a dict of fields (lists repeat a field; Enum values go bare)."""
    pad, lines = "  " * indent, []
    for key, value in message.items():
        if isinstance(value, dict):
            lines += [f"{pad}{key} {{", to_pbtxt(value, indent + 1), f"{pad}}}"]
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for item in value:
                lines += [f"{pad}{key} {{", to_pbtxt(item, indent + 1), f"{pad}}}"]
        elif isinstance(value, list):
            lines.append(f"{pad}{key}: [{', '.join(_scalar(v) for v in value)}]")
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")
    return "\n".join(line for line in lines if line)


def _scalar(value) -> str:
    if isinstance(value, Enum):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a quoted string with C-style escapes, which text format reads
    return str(value)


@dataclasses.dataclass
class TritonExport:
    """What was written: the model folder, its files, and the command that serves it."""

    model_dir: Path
    platform: str
    files: list[str]
    command: str


def export_triton(bundle_path: Path, repo: Path, name: str | None = None, *, platform: str = "onnxruntime",
                  max_delay_ms: float = 2.0, instances: int = 1, device: str = "cuda", server_repo: str = "/models",
                  warmup_runs: int = 3, trust_native: bool = False, allow_failed: bool = False,
                  allow_nan: bool = False, force: bool = False) -> TritonExport:
    """Write ``repo/name`` for Triton. ``server_repo`` is where the repository is mounted in the Triton
    container (the op library is named by that path); native code goes in only as ``deploykit.load``
    would run it (made by this machine's deploykit, or ``trust_native``)."""
    from deploykit.runtime.choose import parse_device

    if platform not in PLATFORMS:
        raise BadInputError(f"--platform {platform}: use {' or '.join(PLATFORMS)}")
    bundle = open_bundle(bundle_path)
    check_validation(bundle, allow_failed)
    name = name or bundle.path.resolve().name
    if not name or any(c in name for c in "/\\\0") or name in (".", ".."):
        raise BadInputError(f"--name {name!r}: a model name is a plain folder name")
    kind, device_id = parse_device(device)
    if kind == "auto":
        raise BadInputError("--device auto: say where Triton runs the model, cpu or cuda[:N]")
    if allow_nan and platform != "python":
        raise BadInputError(f"--allow-nan is for --platform python: Triton's {platform} backend passes NaN through")
    if platform == "tensorrt" and kind != "cuda":
        raise BadInputError("TensorRT runs on the GPU only: use --device cuda (or --platform onnxruntime)")
    model_dir = repo / name
    if model_dir.exists() and not force:
        raise BadInputError(f"{model_dir} exists: pass --force to replace it, or choose another --name")
    dynamic = batch_range(bundle.inputs, bundle.outputs)
    max_batch = dynamic[2] if dynamic else 0
    preferred = [] if platform == "python" else _preferred_sizes(bundle, dynamic)
    config = model_config(name, PLATFORMS[platform], bundle.inputs, bundle.outputs, max_batch, preferred,
                          max_delay_ms, instances, [device_id] * instances if kind == "cuda" else None)
    if warmup := model_warmup(bundle.inputs, _warmup_sizes(bundle, platform, dynamic, preferred), warmup_runs,
                              max_batch > 0, random=platform != "python"):
        config["model_warmup"] = warmup
    if platform == "python":
        config.update(_consent_parameters(trust_native=trust_native, allow_failed=allow_failed, allow_nan=allow_nan))
    staging = repo / f".{name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "1").mkdir(parents=True)
    try:
        files, readme = _write_model(bundle, staging, config, platform, f"{server_repo.rstrip('/')}/{name}",
                                     trust_native)
        (staging / "config.pbtxt").write_text(to_pbtxt(config) + "\n")
        command = _command(server_repo, name, readme["plugins"])
        (staging / "README.md").write_text(_readme(name, bundle, platform, readme, command, server_repo))
        if model_dir.exists():
            shutil.rmtree(model_dir)
        staging.rename(model_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return TritonExport(model_dir, PLATFORMS[platform], ["config.pbtxt", "README.md", *files], command)


def _preferred_sizes(bundle: Bundle, dynamic: tuple | None) -> list[int]:
    """Triton's preferred_batch_size: the validated sizes. Triton runs a batch of a preferred size
    at once, so with 1 among them a lone request never waits for others; the python model leaves
    them out: it pads runs up to its buckets itself, and Triton then waits up to max_queue_delay
    for max_batch_size rows, as serve's batcher does."""
    return sorted({b for b in bundle.manifest.get("validation", {}).get("batch_sizes", [])
                   if dynamic and dynamic[0] <= b <= dynamic[2]})


def _warmup_sizes(bundle: Bundle, platform: str, dynamic: tuple | None, preferred: list[int]) -> list[int]:
    """The batch sizes model_warmup runs: the python model pads runs up to the validated and tuned
    sizes on a GPU (as serve does), so it warms up at each; Triton's own backends at the preferred ones."""
    from deploykit.serving.models import validated_buckets

    if dynamic is None:
        return [1]
    if platform == "python":
        return validated_buckets(bundle.manifest, dynamic[0], dynamic[2])
    return preferred or [dynamic[2]]


def _consent_parameters(**flags: bool) -> dict:
    """The consent flags given, as the config parameters the python model loads with (their keys
    are ServeOptions fields, triton_model.FLAGS)."""
    given = [{"key": key, "value": {"string_value": "true"}} for key, on in flags.items() if on]
    return {"parameters": given} if given else {}


def _write_model(bundle: Bundle, out: Path, config: dict, platform: str, served_at: str,
                 trust_native: bool) -> tuple[list[str], dict]:
    """The model file and the native library it needs, copied in; what the README must say."""
    if platform == "python":
        return _write_python_model(bundle, out, trust_native)
    if platform == "onnxruntime":
        shutil.copyfile(bundle.file(bundle.model), out / "1" / "model.onnx")
        files, notes = ["1/model.onnx"], {"plugins": None, "library": None}
        if bundle.op_library:
            library = trust.op_library(bundle, True, trust_native)
            shutil.copyfile(library, out / library.name)
            config["model_operations"] = {"op_library_filename": [f"{served_at}/{library.name}"]}
            files.append(library.name)
            notes["library"] = library.name
        return files, notes
    entry = _engine_for_triton(bundle)
    shutil.copyfile(bundle.file(entry["file"]), out / "1" / "model.plan")
    files, notes = ["1/model.plan"], {"plugins": None, "library": None, "engine": entry}
    if trust.has_plugins(entry):
        library = _plugin_library(bundle, entry, trust_native)
        shutil.copyfile(library, out / library.name)
        files.append(library.name)
        notes["plugins"] = f"{served_at}/{library.name}"
    return files, notes


def _write_python_model(bundle: Bundle, out: Path, trust_native: bool) -> tuple[list[str], dict]:
    """``1/model.py`` and the bundle in ``1/bundle``: its manifest and the files it lists, each
    checked against its sha256 on the way."""
    from deploykit.serving import triton_model

    copied = out / "1" / triton_model.BUNDLE_FOLDER
    copied.mkdir()
    for name in bundle.manifest.get("files", {}):
        shutil.copyfile(bundle.file(name), copied / name)
    shutil.copyfile(bundle.path / MANIFEST, copied / MANIFEST)
    (out / "1" / "model.py").write_text(MODEL_PY)
    return ["1/model.py", f"1/{triton_model.BUNDLE_FOLDER}/"], {"plugins": None, "library": None,
                                                                 "trusted": trust_native}


def _engine_for_triton(bundle: Bundle) -> dict:
    engines = [e for e in bundle.engines if e["flavour"] == "tensorrt"]
    if not engines:
        why = ("its engines are TensorRT-RTX, which Triton's TensorRT backend does not run"
               if bundle.engines else "it has no TensorRT engine")
        raise BadInputError(f"{bundle.path} cannot be exported as tensorrt_plan: {why}; convert with --backend "
                            "tensorrt on the GPU Triton runs on, or export with --platform onnxruntime")
    return engines[0]


def _plugin_library(bundle: Bundle, entry: dict, trust_native: bool) -> Path:
    """This machine's plugin library when it is the one the engine embeds (Triton loads it beside the
    engine, so it must be the same build)."""
    from deploykit.native import build as native

    trust.engine_host_code_allowed(bundle, entry, trust_native)  # consent, as loading the engine needs
    library = native.build_plugins().tensorrt_library
    if library is None:
        raise EnvironmentProblem("the TensorRT plugin library is not built here (deploykit build-plugins says why): "
                                 "Triton needs it beside the engine")
    wanted = entry.get("plugin_library_sha256")
    if wanted and sha256_of(library) != wanted:
        raise BadInputError(f"{entry['file']} embeds a plugin library other than this machine's build {library}: "
                            "export on the machine that converted the bundle, or export --platform onnxruntime")
    return library


def _command(server_repo: str, name: str, plugins: str | None) -> str:
    backend_config = f" --backend-config=tensorrt,plugins={plugins}" if plugins else ""
    return f"tritonserver --model-repository={server_repo} --model-control-mode=explicit --load-model={name}" \
           + backend_config


def _readme(name: str, bundle: Bundle, platform: str, notes: dict, command: str, server_repo: str) -> str:
    verdict = "passed" if bundle.passed else "FAILED"
    batches = bundle.manifest.get("validation", {}).get("batch_sizes", [])
    heading, needs, serve = _python_needs(notes, command, server_repo) if platform == "python" else \
        ("Versions that must match", _versions_to_match(bundle, platform, notes), _docker_run(command, server_repo))
    return f"""# {name} for Triton Inference Server

Exported by `deploykit export triton` from `{bundle.path.name}` (validation
{verdict} at batch sizes {batches}).

## {heading}

{needs}

## Serve it

{serve}

The tritonclient code that talks to `deploykit serve` works unchanged against it (HTTP on port 8000).
"""


def _versions_to_match(bundle: Bundle, platform: str, notes: dict) -> str:
    if platform == "onnxruntime":
        ort = bundle.recorded_version("onnxruntime-gpu", "onnxruntime") or "unknown"
        must_match = (f"- ONNX Runtime **{ort}** validated this model: use a Triton release whose onnxruntime "
                      "backend ships this version (Triton's release notes list it)")
        if notes["library"]:
            floor = ".".join(map(str, MIN_ORT_FOR_OP_LIBRARY))
            must_match += (f"\n- `{notes['library']}` is deploykit's op library: the backend registers it from "
                           f"`model_operations`; it asks ONNX Runtime's C API for the version of ONNX Runtime {floor}, "
                           f"so that backend must be ONNX Runtime {floor} or newer")
        return must_match
    engine = notes["engine"]
    must_match = (f"- TensorRT **{engine['version']}** built `model.plan` for compute capability "
                  f"{', '.join(engine['targets'])}: use a Triton release with exactly this TensorRT, on such a GPU")
    if notes["plugins"]:
        must_match += "\n- the plugin library beside it is the build embedded in the engine; keep them together"
    return must_match


def _docker_run(command: str, server_repo: str) -> str:
    return f"""```bash
docker run --rm --gpus all -p 8000:8000 -p 8001:8001 -p 8002:8002 \\
    -v "$PWD/REPO:{server_repo}" nvcr.io/nvidia/tritonserver:YY.MM-py3 \\
    {command}
```

Replace `REPO` with this repository's folder and `YY.MM` with the release chosen above."""


def _python_needs(notes: dict, command: str, server_repo: str) -> tuple[str, str, str]:
    """What the python platform asks of the Python that Triton's python backend runs."""
    from deploykit.bundle.format import FORMAT_VERSION
    from deploykit.versions import deploykit_version

    consent = ("it was exported with `--trust-bundle`, so it loads with `trust_native=True`" if notes["trusted"]
               else "it was exported without `--trust-bundle`, so deploykit's own rule applies on the Triton machine")
    version = deploykit_version()
    needs = f"""`1/model.py` runs `1/bundle` through `deploykit.load`, so Triton needs deploykit itself:

- deploykit installed in the Python that Triton's python backend runs (this export: deploykit
  {version}, bundle format {FORMAT_VERSION}; a newer one reads it too), with what the bundle's
  backend needs: `pip install 'deploykit[gpu]'` (or `[cpu]`; `[tensorrt]` for an engine).
- The python backend's stub (`backends/python/triton_python_backend_stub`) is built for one Python
  version and embeds its libpython: use the stub of the Python deploykit is installed in (Triton's
  containers ship one for their system Python; other versions are built from Triton's python_backend).
- The stub ignores PYTHONPATH: it runs the first `python3` on PATH, with that interpreter's
  site-packages (a virtual environment's included). Start tritonserver with the environment's
  `bin` first on PATH and its libpython's folder
  (`python3 -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))'`) on LD_LIBRARY_PATH.
  It also puts its working directory first on sys.path: start tritonserver outside a source tree
  of deploykit unless that is the deploykit to run.
- The bundle's files are checked against their sha256 when each instance starts: a changed file
  fails the model's load (`POST /v2/repository/index` gives the reason).
- Native code in the bundle (op library, engine plugins, AOTInductor packages) runs as
  `deploykit.load` allows it (docs/security.md):
  {consent}.
- Triton's HTTP frontend answers a truncated JSON body with 500, where `deploykit serve` answers 400."""
    serve = f"""In Triton's container, with deploykit installed into its Python:

```dockerfile
FROM nvcr.io/nvidia/tritonserver:YY.MM-py3
RUN pip install 'deploykit[gpu]'
```

```bash
docker run --rm --gpus all -p 8000:8000 -p 8001:8001 -p 8002:8002 \\
    -v "$PWD/REPO:{server_repo}" IMAGE {command}
```

Or outside a container, from the virtual environment VENV that holds deploykit:

```bash
PATH=VENV/bin:$PATH LD_LIBRARY_PATH=LIBDIR {command.replace(server_repo, "REPO", 1)}
```"""
    return "What Triton needs", needs, serve
