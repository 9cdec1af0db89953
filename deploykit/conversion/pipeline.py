"""What the CLI calls and users import: ``convert()`` runs the pipeline stage by stage.

load -> check inputs -> export -> passes -> [precision] -> [op library] -> [TensorRT engine] -> validate
-> [auto-fix] -> report -> bundle (see DESIGN.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import shutil
from pathlib import Path

import numpy as np
import onnx
import torch

from deploykit.bundle import write as bundle
from deploykit.bundle.format import FORMAT, FORMAT_VERSION
from deploykit.backends.onnxruntime.loader import OpLibrary, find_op_library
from deploykit.backends.onnxruntime.runner import OnnxRuntimeRunner
from deploykit.backends.torch.runner import TorchRunner
from deploykit.validation.compare import FP32_NOISE_MARGIN, parse_tolerances
from deploykit.conversion.precision import REFERENCE_MODEL, PrecisionStage
from deploykit.conversion.engine import build_tensorrt_stage
from deploykit.errors import BadInputError, DeployKitError, error_summary
from deploykit.conversion.export import DEFAULT_OPSET, check_program_batch, export_onnx
from deploykit.validation.inputs import load_feeds, random_feeds
from deploykit.conversion.loading import LoadedModel, count_batch_norms, load_model
from deploykit.ops import custom_op_types
from deploykit.passes import op_histogram, run_passes
from deploykit.passes.precision import check_precision
from deploykit.report import render_html
from deploykit.specs import BatchRange, InputSpec
from deploykit.validation.validate import CandidateValidation, validate
from deploykit.versions import tool_versions


@dataclasses.dataclass
class ConvertOptions:
    model: Path
    output: Path
    inputs: list[InputSpec] = dataclasses.field(default_factory=list)
    custom_ops: bool = True
    backend: str = "onnxruntime"
    trt_targets: list[str] | None = None
    trt_workspace_bytes: int | None = None
    batch: BatchRange | None = None
    factory: str | None = None
    trust_pickle: bool = False
    exporter: str = "auto"
    opset: int = DEFAULT_OPSET
    feeds_path: Path | None = None
    seed: int = 0
    tolerances: list[str] = dataclasses.field(default_factory=list)
    force: bool = False
    precision: str = "fp32"  # fp16/bf16: docs/precision.md
    io_precision: str | None = None  # None: inputs and outputs keep their declared types
    auto_fix: bool = False  # pin the nodes that break reduced-precision validation to fp32


@dataclasses.dataclass
class ConvertResult:
    out_dir: Path
    report: dict
    validations: list[CandidateValidation]

    @property
    def passed(self) -> bool:
        return self.report["verdict"] == "pass"


def _no_stage(_title: str):
    return contextlib.nullcontext()


def convert(options: ConvertOptions, stage=_no_stage) -> ConvertResult:
    """Convert, validate and bundle a model. ``stage(title)`` wraps each step (progress display)."""
    bundle.check_destination(Path(options.output).absolute(), options.force)
    check_precision(options.precision, options.io_precision, options.auto_fix)
    conversion = Conversion(options)
    for title, step in conversion.steps():
        with stage(title):
            step()
    return ConvertResult(Path(options.output).absolute(), conversion.report, conversion.validations)


class Conversion:
    """One conversion's state, handed from step to step. ``steps()`` yields each step when its
    turn comes, so a step is chosen by what the earlier ones found (custom ops in the graph, a
    failed reduced-precision validation)."""

    def __init__(self, options: ConvertOptions):
        self.options = options
        self.precision: PrecisionStage | None = None
        self.library = OpLibrary(None, "the graph uses no deploykit op")
        self.engine = None
        self.report: dict = {}

    def steps(self):
        options = self.options
        yield "Loading the model", self.load
        yield "Running the model in PyTorch", self.run_reference
        yield "Exporting ONNX", self.export
        yield "Optimizing the graph", self.optimize
        if options.precision != "fp32":
            yield f"Writing {options.precision} into the graph", self.write_precision
        if custom_op_types(self.optimized):
            yield "Building deploykit's op library (cached after the first run)", self.find_op_library
        if options.backend in ("tensorrt", "all"):
            yield "Building the TensorRT engine", self.build_engine
        yield "Validating against PyTorch", self.validate
        # the plain export (last candidate) does not decide whether pinning can help
        if self.precision is not None and options.auto_fix and not all(v.passed for v in self.validations[:-1]):
            yield "Pinning the nodes that diverge to fp32 (--auto-fix)", self.auto_fix
        yield "Writing the bundle", self.write_bundle

    def load(self) -> None:
        options = self.options
        self.loaded = load_model(options.model, options.factory, options.trust_pickle)
        if self.loaded.program is not None:
            check_program_batch(self.loaded.program, options.batch)
        self.specs = resolve_input_specs(self.loaded, options.inputs, options.batch)

    def run_reference(self) -> None:
        self.reference = TorchRunner(self.loaded, [spec.name for spec in self.specs])
        self.example = _example_inputs(self.specs, self.options.batch)
        _probe(self.reference, self.example, self.specs)

    def export(self) -> None:
        options = self.options
        self.exported = export_onnx(self.loaded, {k: torch.from_numpy(v) for k, v in self.example.items()},
                                    self.reference.output_names, options.batch, options.opset, options.exporter)

    def optimize(self) -> None:
        self.optimized, self.pass_stats = run_passes(self.exported.model, custom_ops=self.options.custom_ops)

    def write_precision(self) -> None:
        options = self.options
        self.precision = PrecisionStage.start(self.optimized, options.precision, options.io_precision, self.example)
        self.optimized = self.precision.model
        self.pass_stats.append(self.precision.result.stats)

    def find_op_library(self) -> None:
        self.library = find_op_library()

    def build_engine(self) -> None:
        options = self.options
        self.engine = build_tensorrt_stage(self.optimized, self.specs, options.batch, options.trt_targets,
                                           options.trt_workspace_bytes, options.precision)

    def validate(self) -> None:
        self.feed_sets = _validation_feeds(self.specs, self.options)
        self.tolerances = parse_tolerances(self.options.tolerances, self.options.precision,
                                           self.reference.output_names)
        candidates = _candidates(self.exported.model, self.optimized, self.library, self.engine, self.precision)
        _check_signature(candidates[_first_onnx_label(candidates)], self.specs, self.reference.output_names)
        self.validations = validate(self.reference, candidates, self.feed_sets, self.tolerances, PLAIN_EXPORT)

    def auto_fix(self) -> None:
        self.optimized = self.precision.auto_fix(self.reference, self.feed_sets, self.validations[0], self.tolerances,
                                                 self.library.path)
        self.pass_stats[-1] = self.precision.result.stats
        if self.engine is not None:
            self.build_engine()
        candidates = _candidates(self.exported.model, self.optimized, self.library, self.engine, self.precision)
        self.validations = validate(self.reference, candidates, self.feed_sets, self.tolerances, PLAIN_EXPORT)

    def write_bundle(self) -> None:
        self.report = build_report(self.options, self.loaded, self.specs, self.exported, self.optimized,
                                   self.pass_stats, self.validations, self.library, self.engine, self.precision)
        with bundle.staged_bundle(self.options.output, self.options.force) as (staging, manifest):
            onnx.save_model(self.optimized, staging / "model.onnx")
            if self.precision is not None:
                onnx.save_model(self.precision.fp32, staging / REFERENCE_MODEL)
            if self.library.path is not None:
                shutil.copy2(self.library.path, staging / self.library.path.name)
            if self.engine is not None:
                (staging / self.engine.file_name).write_bytes(self.engine.build.engine)
            bundle.write_json(staging / "report.json", self.report)
            (staging / "report.html").write_text(render_html(self.report, self.validations))
            manifest.update(build_manifest(self.report, self.optimized))


#: The exporter's graph before any pass: tells where a failure comes from, and is a second fp32
#: implementation of the model for validate()'s float64 judgement.
PLAIN_EXPORT = "plain export"


def _candidates(plain: onnx.ModelProto, optimized: onnx.ModelProto, library: OpLibrary, engine,
                precision: PrecisionStage | None = None) -> dict:
    """What validation compares with PyTorch; the first is the bundle as it will run."""
    candidates = {}
    if engine is not None and engine.runner is not None:
        candidates["tensorrt engine"] = engine.runner
    if precision is not None:
        candidates.update(precision.candidates(library.path))
    elif library.path is not None:
        candidates["deploykit graph + op library"] = OnnxRuntimeRunner.from_model(optimized, library.path)
        candidates["deploykit graph, ONNX functions"] = OnnxRuntimeRunner.from_model(optimized)
    else:
        candidates["deploykit graph"] = OnnxRuntimeRunner.from_model(optimized)
    candidates[PLAIN_EXPORT] = OnnxRuntimeRunner.from_model(plain)
    return candidates


def resolve_input_specs(
    loaded: LoadedModel, specs: list[InputSpec], batch: BatchRange | None
) -> list[InputSpec]:
    """Match the declared inputs to the model's arguments, in the model's order."""
    names = loaded.input_names
    if not specs:
        if loaded.program is None:
            raise BadInputError(
                f"declare the model's inputs with --input NAME:SHAPE (model inputs: {', '.join(names) or '?'}), "
                "e.g. --input x:1x3x224x224"
            )
        specs = _program_input_specs(loaded.program)
    by_name = {spec.name: spec for spec in specs}
    if len(by_name) != len(specs):
        raise BadInputError("--input names an input twice; give each input once")
    if names and set(by_name) != set(names):
        unknown = sorted(set(by_name) - set(names))
        missing = [n for n in names if n not in by_name]
        problem = f"no input named {', '.join(unknown)}" if unknown else f"missing --input for {', '.join(missing)}"
        raise BadInputError(f"--input does not match the model: {problem}; the model takes {', '.join(names)}")
    ordered = [by_name[name] for name in names] if names else specs
    if batch is not None:
        ordered = [spec.with_batch(batch.opt) for spec in ordered]
    return ordered


def _program_input_specs(program: torch.export.ExportedProgram) -> list[InputSpec]:
    placeholders = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    specs = []
    for name in program.graph_signature.user_inputs:
        value = placeholders[name].meta["val"]
        shape = tuple(int(d) if isinstance(d, int) else int(d.node.hint or 1) for d in value.shape)
        dtype = str(value.dtype).removeprefix("torch.")
        specs.append(InputSpec(name, shape, np.dtype(dtype).name))
    return specs


def _example_inputs(specs: list[InputSpec], batch: BatchRange | None) -> dict[str, np.ndarray]:
    """Export inputs. A dynamic batch is traced at size >= 2, as torch.export specialises 0 and 1."""
    if batch is not None and batch.max >= 2:
        specs = [spec.with_batch(max(2, batch.opt)) for spec in specs]
    return random_feeds(specs, seed=1234)


def _probe(reference: TorchRunner, example: dict[str, np.ndarray], specs: list[InputSpec]) -> None:
    try:
        reference.run(example)
    except DeployKitError:
        raise
    except Exception as error:
        declared = " ".join(spec.describe() for spec in specs)
        raise BadInputError(
            f"the model rejects inputs {declared}: {error_summary(error)[:300]}; check the rank, sizes "
            "and dtype given with --input"
        ) from error


def _validation_feeds(specs: list[InputSpec], options: ConvertOptions) -> list[dict[str, np.ndarray]]:
    """One feed set per validated batch size: both ends and the optimum of a dynamic range."""
    if options.feeds_path is not None:
        feeds = load_feeds(options.feeds_path, specs)
        size = next(iter(feeds.values())).shape[0]
        if options.batch is None:
            if size != specs[0].shape[0]:
                raise BadInputError(
                    f"--inputs has batch {size} but the model was declared with batch "
                    f"{specs[0].shape[0]}; pass --batch MIN:OPT:MAX or match the size"
                )
            return [feeds]
        if not options.batch.min <= size <= options.batch.max:
            raise BadInputError(f"--inputs has batch {size}, outside --batch {options.batch.min}..{options.batch.max}")
        sizes = sorted({s for s in options.batch.validation_sizes() if s <= size} | {size})
        return [{name: array[:s] for name, array in feeds.items()} for s in sizes]
    sizes = options.batch.validation_sizes() if options.batch else [specs[0].shape[0]]
    return [
        random_feeds([spec.with_batch(size) for spec in specs], options.seed + index)
        for index, size in enumerate(sizes)
    ]


def _first_onnx_label(candidates: dict) -> str:
    return next(label for label, runner in candidates.items() if isinstance(runner, OnnxRuntimeRunner))


def _check_signature(runner: OnnxRuntimeRunner, specs: list[InputSpec], output_names: list[str]) -> None:
    if runner.input_names != [spec.name for spec in specs] or runner.output_names != output_names:
        raise DeployKitError(
            f"the exported graph's signature ({runner.input_names} -> {runner.output_names}) differs from "
            f"the model's ({[s.name for s in specs]} -> {output_names}); please report this"
        )


def _value_info(value: onnx.ValueInfoProto) -> dict:
    tensor = value.type.tensor_type
    return {
        "name": value.name,
        "dtype": onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name,
        "shape": [d.dim_param or d.dim_value for d in tensor.shape.dim],
    }


def _shape_text(spec: InputSpec, batch: BatchRange | None) -> str:
    dims = ["N", *map(str, spec.shape[1:])] if batch else list(map(str, spec.shape))
    return "x".join(dims)


def _batch_norm_count(model: onnx.ModelProto) -> int:
    return sum(node.op_type == "BatchNormalization" for node in model.graph.node)


def build_report(options, loaded, specs, exported, optimized, pass_stats, validations, library, engine=None,
                 precision: PrecisionStage | None = None) -> dict:
    # Everything the bundle ships must pass; the plain export only tells where a failure came from.
    shipped, plain = validations[:-1], validations[-1]
    final = shipped[0]
    passed = all(v.passed for v in shipped)
    failures = [line for v in shipped for line in v.failures()]
    failed_checks = len(failures)
    if failures:
        failures.append(
            "the plain export fails as well, so the exporter (not deploykit's passes) lost accuracy"
            if not plain.passed else
            f"the fp32 export passes, so {options.precision} lost the accuracy: deploykit debug BUNDLE names the "
            "nodes, convert --auto-fix pins them to fp32" if precision is not None else
            "the plain export passes, so a deploykit pass changed the results: please report this"
        )
    rounding = final.rounding_notes()
    worst = max((o.metrics.get("max_abs", float("inf")) for r in final.runs for o in r.outputs), default=0.0)
    batch_sizes = [run.batch for run in final.runs]
    sizes = ", ".join(map(str, batch_sizes))
    verdict = "pass" if passed else "fail"
    before, after = op_histogram(exported.model), op_histogram(optimized)
    return {
        "verdict": verdict,
        "summary": (
            f"{final.label} in {final.backend} matches PyTorch on batch sizes {sizes} "
            f"(worst max abs error {worst:.3g}{', within fp32 rounding' if rounding else ''})" if passed
            else f"{failed_checks} check(s) failed on batch sizes {sizes}"
        ),
        "failures": failures,
        "notes": rounding,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {
            "source": str(options.model),
            "kind": loaded.kind,
            "inputs": [{"name": s.name, "dtype": s.dtype, "shape": _shape_text(s, options.batch)} for s in specs],
            "batch": options.batch.to_json() if options.batch else None,
        },
        "export": {"exporter": exported.exporter, "opset": exported.opset},
        "engines": [engine.to_json()] if engine else [],
        "custom_ops": {
            "ops": custom_op_types(optimized),
            "library": library.path.name if library.path else None,
            "note": library.note,
        },
        "passes": [s.to_json() for s in pass_stats],
        "precision": precision.to_json() if precision is not None else {"precision": "fp32"},
        "graph": {
            "nodes_before": len(exported.model.graph.node),
            "nodes_after": len(optimized.graph.node),
            "batch_norm_in_model": count_batch_norms(loaded),
            "batch_norm_before": _batch_norm_count(exported.model),
            "batch_norm_after": _batch_norm_count(optimized),
            "ops": [{"name": op, "before": before.get(op, 0), "after": after.get(op, 0)}
                    for op in sorted(set(before) | set(after))],
        },
        "validation": {
            "reference": "pytorch-fp32-cpu",
            "fp32_noise_margin": FP32_NOISE_MARGIN,
            "inputs": str(options.feeds_path) if options.feeds_path else f"seeded random (seed {options.seed})",
            "batch_sizes": batch_sizes,
            "passed": passed,
            "candidates": [v.to_json() for v in validations],
        },
        "versions": tool_versions(),
    }


def build_manifest(report: dict, model: onnx.ModelProto) -> dict:
    batch = report["model"]["batch"]
    inputs = [_value_info(value) for value in model.graph.input]
    for entry in inputs:
        if batch:
            entry["dynamic"] = {"0": batch}
    final = report["validation"]["candidates"][0]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": report["created"],
        "source": report["model"]["source"],
        "model": "model.onnx",
        "precision": report["precision"]["precision"],
        "reference_model": report["precision"].get("reference_model"),
        "opset": next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                      report["export"]["opset"]),  # bf16 graphs move to opset 22
        "ir_version": model.ir_version,
        "exporter": report["export"]["exporter"],
        "inputs": inputs,
        "outputs": [_value_info(value) for value in model.graph.output],
        "passes": report["passes"],
        "engines": report["engines"],
        "custom_op_libraries": [
            {"file": report["custom_ops"]["library"], "runtime": "onnxruntime", "register": "RegisterCustomOps",
             "ops": report["custom_ops"]["ops"]}
        ] if report["custom_ops"]["library"] else [],
        "versions": report["versions"],
        "validation": {
            "passed": report["validation"]["passed"],
            "backend": final["backend"],
            "batch_sizes": report["validation"]["batch_sizes"],
            "max_abs": {o["name"]: o["metrics"].get("max_abs") for o in final["runs"][-1]["outputs"]},
        },
    }
