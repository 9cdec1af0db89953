"""The AOTInductor stage of a conversion (``--backend aoti``, or ``all`` on a GPU): the PyTorch
model in the bundle's precision, exported with torch.export and compiled ahead of time by
``torch._inductor.aoti_compile_and_package`` into packages (a zip holding a compiled .so) for
this machine's device, and a runner per package kind that validation compares with PyTorch.

Kept apart from the pipeline because it is optional and compiles C++ (slow): it runs only when asked.
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
from pathlib import Path

import torch

from deploykit.backends.aoti.loader import Package, load_package
from deploykit.backends.aoti.runner import AotiRunner, CudaGraph, exact_fp32, flat_outputs
from deploykit.backends.torch.runner import flatten_outputs
from deploykit.conversion.fp8 import Fp8Stage, check_device as check_fp8_device
from deploykit.conversion.loading import LoadedModel
from deploykit.errors import BadInputError, DeployKitError, EnvironmentProblem, error_summary
from deploykit.specs import BatchRange, InputSpec
from deploykit.validation.inputs import random_feeds

#: ``--aoti-shapes``: one package over the batch range, one per validated batch size, or both.
SHAPES = ("dynamic", "static", "both")
#: what the packages compute in; fp8's Linear products are fp8 (:mod:`deploykit.conversion.fp8`), the rest fp16
TORCH_TYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float16}
#: inductor settings per package device, recorded in each manifest entry. On cuda, freezing lets
#: inductor fold the weights as constants and lay them out once (channels-last convolutions without
#: a weight conversion per call); benchmarks/probe_aoti_configs.py times it against no freezing.
INDUCTOR_CONFIGS = {"cuda": {"freezing": True}, "cpu": {}}
_TORCHSCRIPT = "TorchScript cannot be compiled by AOTInductor (it compiles torch.export programs)"


@dataclasses.dataclass
class CompiledPackage:
    entry: dict  # the manifest's entry; ``validated`` is set once validation has run
    path: Path  # in the stage's temporary folder until the bundle is written
    label: str  # the validation candidate that runs it


@dataclasses.dataclass
class AotiStage:
    """The packages compiled for the bundle, the candidates that validate them, and what to tell the user."""

    packages: list[CompiledPackage]
    runners: dict[str, AotiRunner]
    note: str
    folder: tempfile.TemporaryDirectory | None = None

    def entries(self, validations) -> list[dict]:
        """The manifest's ``aoti`` list: a package is validated when every batch it ran passed."""
        by_label = {v.label: v for v in validations}
        for package in self.packages:
            served = self.runners[package.label].served
            runs = [run for run in by_label[package.label].runs if served.get(run.batch) == package.entry["file"]]
            package.entry["validated"] = bool(runs) and all(run.passed for run in runs)
        return [package.entry for package in self.packages]

    def to_json(self, validations) -> dict:
        return {"packages": self.entries(validations), "note": self.note}


def check_source(loaded: LoadedModel, backend: str, shapes: str) -> None:
    """Before any work: ``--backend aoti`` needs a model torch.export can trace."""
    if shapes not in SHAPES:
        raise BadInputError(f"--aoti-shapes {shapes}: use one of {', '.join(SHAPES)}")
    if backend == "aoti" and loaded.kind == "torchscript":
        raise BadInputError(f"--backend aoti: {_TORCHSCRIPT}; save the model with torch.export.save, or pass "
                            "its state_dict with --factory, or use --backend onnxruntime")


def skip_reason(loaded: LoadedModel, backend: str) -> str | None:
    """Why ``--backend all`` compiles no package here (None: it does; ``aoti`` always compiles)."""
    if backend != "all":
        return None
    if loaded.kind == "torchscript":
        return f"AOTInductor packages not compiled: {_TORCHSCRIPT}"
    if not torch.cuda.is_available():
        return ("AOTInductor packages not compiled: --backend all compiles them for a GPU and torch sees none "
                "here (--backend aoti compiles them for this CPU)")
    major, minor = torch.cuda.get_device_capability()
    if not {f"sm_{major}{minor}", f"compute_{major}{minor}"} & set(torch.cuda.get_arch_list()):
        return (f"AOTInductor packages not compiled: torch {torch.__version__} is not built for compute "
                f"capability {major}.{minor} ({', '.join(torch.cuda.get_arch_list())})")
    return None


def build_aoti_stage(loaded: LoadedModel, specs: list[InputSpec], io: tuple[list[dict], list[dict]],
                     batch: BatchRange | None, sizes: list[int], shapes: str, precision: str,
                     fp8_stage: Fp8Stage | None = None) -> AotiStage:
    """Compile the packages ``shapes`` asks for (one static package where the batch is fixed) for
    cuda when torch sees a GPU, else for the CPU; ``io`` is the bundle's (inputs, outputs) specs;
    ``fp8_stage`` (fp8): the Linear layers to compute in fp8."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _as_deployed(loaded, io, precision, device)
    if fp8_stage is not None:
        check_fp8_device(device)
        fp8_stage.apply(model.module)
    folder = tempfile.TemporaryDirectory(prefix="deploykit-aoti-")
    packages, loaded_packages = [], {}
    for kind, batch_range in _plan(batch, sizes, shapes):
        name = f"aoti-{device}-{'dynamic' if kind == 'dynamic' else 'b' + str(batch_range.min)}.pt2"
        path = Path(folder.name) / name
        example = _example(specs, io[0], batch_range, device)
        _compile(model, example, batch_range if kind == "dynamic" else None, path, INDUCTOR_CONFIGS[device])
        entry = _entry(name, device, batch_range, precision)
        package = load_package(path, entry, cuda_graph=device == "cuda")
        entry["cuda_graph"] = package.cuda_graph = device == "cuda" and _graph_replays(package, example)
        label = f"aoti {device} {'dynamic package' if kind == 'dynamic' else 'static packages'}"
        packages.append(CompiledPackage(entry, path, label))
        loaded_packages.setdefault(label, []).append(package)
    runners = {label: AotiRunner(group, device, inputs=io[0], outputs=io[1], cast_inputs=True, name=f"aoti-{device}")
               for label, group in loaded_packages.items()}
    return AotiStage(packages, runners, _where(device, packages), folder)


class _AsDeployed(torch.nn.Module):
    """The model as a package runs it: inputs in the bundle's io dtypes, computed in its precision,
    the outputs a flat tuple in the bundle's output dtypes."""

    def __init__(self, module: torch.nn.Module, compute: torch.dtype, outputs: list[torch.dtype]):
        super().__init__()
        self.module, self.compute, self.output_types = module, compute, outputs

    def forward(self, *args):
        args = [arg.to(self.compute) if arg.is_floating_point() else arg for arg in args]
        results = flatten_outputs(self.module(*args))
        return tuple(result.to(dtype) for result, dtype in zip(results, self.output_types))


def _as_deployed(loaded: LoadedModel, io: tuple[list[dict], list[dict]], precision: str, device: str) -> _AsDeployed:
    compute = TORCH_TYPES[precision]
    module = copy.deepcopy(loaded.module).to(device=device, dtype=compute).eval()
    return _AsDeployed(module, compute, [getattr(torch, spec["dtype"]) for spec in io[1]])


def _plan(batch: BatchRange | None, sizes: list[int], shapes: str) -> list[tuple[str, BatchRange]]:
    """(kind, batch range) of each package: a fixed batch gets its one static package."""
    if batch is None or batch.min == batch.max:
        return [("static", BatchRange(sizes[0], sizes[0], sizes[0]))]
    plan = [("dynamic", batch)] if shapes in ("dynamic", "both") else []
    if shapes in ("static", "both"):
        plan += [("static", BatchRange(size, size, size)) for size in sizes]
    return plan


def _example(specs: list[InputSpec], inputs: list[dict], batch: BatchRange, device: str) -> list[torch.Tensor]:
    """Export inputs in the bundle's io dtypes. A dynamic batch is traced at size >= 2, as
    torch.export specialises sizes 0 and 1."""
    size = batch.min if batch.min == batch.max else min(max(2, batch.opt), batch.max)
    feeds = random_feeds([spec.with_batch(size) for spec in specs], seed=1234)
    return [torch.from_numpy(feeds[spec.name]).to(device=device, dtype=getattr(torch, io["dtype"]))
            for spec, io in zip(specs, inputs)]


def _compile(model: _AsDeployed, example: list[torch.Tensor], dynamic: BatchRange | None, path: Path,
             configs: dict) -> None:
    program = _export(model, example, dynamic)
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=dict(configs))
    except Exception as error:  # inductor raises many kinds: toolchain, lowering, codegen
        raise _compile_error(error) from error


def _export(model: _AsDeployed, example: list[torch.Tensor], dynamic: BatchRange | None):
    dims = None
    if dynamic is not None:
        batch = torch.export.Dim("batch", min=dynamic.min, max=dynamic.max)
        dims = (tuple({0: batch} for _ in example),)
    try:
        return torch.export.export(model, tuple(example), dynamic_shapes=dims, strict=False)
    except DeployKitError:
        raise
    except Exception as error:
        if dynamic is not None:
            raise BadInputError(f"torch.export cannot export the model with a dynamic batch "
                                f"{dynamic.min}..{dynamic.max} for AOTInductor: {error_summary(error)[:300]}; pass "
                                "--aoti-shapes static (one package per batch size)") from error
        raise BadInputError(f"torch.export cannot export the model for AOTInductor: {error_summary(error)[:300]}; "
                            "convert with --backend onnxruntime") from error


def _compile_error(error: Exception) -> DeployKitError:
    """A missing or broken toolchain (C++ compiler, CUDA headers, Triton) is the environment's (exit 3);
    anything else inductor cannot compile is the model's (exit 2): neither is deploykit's bug."""
    from torch._inductor import exc

    summary = error_summary(error)[:300]
    toolchain = (exc.InvalidCxxCompiler, exc.CppCompileError, exc.CUDACompileError, OSError)
    if isinstance(error, toolchain) or "triton" in str(error).lower():
        return EnvironmentProblem(f"AOTInductor (torch {torch.__version__}) cannot compile here: {summary}; install "
                                  "a C++ compiler (g++), and for a GPU the CUDA toolkit and triton, or convert "
                                  "with --backend onnxruntime")
    return BadInputError(f"AOTInductor (torch {torch.__version__}) cannot compile the model: {summary}; convert "
                         "with --backend onnxruntime")


def _entry(name: str, device: str, batch: BatchRange, precision: str) -> dict:
    """The manifest entry: what the package needs to load (torch, GPU architecture or CPU ISA)."""
    entry = {"file": name, "device": device, "torch": torch.__version__, "cuda_arch": None, "gpu": None,
             "cpu_isa": None, "batch": batch.to_json(), "precision": precision, "cuda_graph": False,
             "inductor_configs": dict(INDUCTOR_CONFIGS[device]), "validated": False}
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        entry.update(cuda_arch=f"{major}.{minor}", gpu=torch.cuda.get_device_name())
    else:
        from torch._inductor import cpu_vec_isa

        isa = cpu_vec_isa.pick_vec_isa()
        entry["cpu_isa"] = str(isa) if isa else None
    return entry


def _graph_replays(package: Package, example: list[torch.Tensor]) -> bool:
    """Whether the package can be captured as a CUDA graph whose replay gives the plain run's outputs."""
    with torch.inference_mode(), exact_fp32(package.entry):
        plain = flat_outputs(package.model(*example))
        try:
            replayed = CudaGraph(package.model, example)(example)
        except DeployKitError:
            return False
        torch.cuda.current_stream().synchronize()
    # the same kernels on the same inputs: equal, bar kernels that reduce in a varying order
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(plain, replayed))


def _where(device: str, packages: list[CompiledPackage]) -> str:
    target = (f"{packages[0].entry['gpu']} (compute capability {packages[0].entry['cuda_arch']})" if device == "cuda"
              else f"this CPU ({packages[0].entry['cpu_isa'] or 'no vector ISA'})")
    graphs = [p.entry["file"] for p in packages if p.entry["cuda_graph"]]
    replay = f"; replayed as CUDA graphs: {', '.join(graphs)}" if graphs else ""
    return (f"compiled by torch {torch.__version__} for {target}: {', '.join(p.entry['file'] for p in packages)}"
            f"{replay}")

