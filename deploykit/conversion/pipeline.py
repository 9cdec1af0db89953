"""What the CLI calls and users import: ``convert()`` runs the pipeline stage by stage.

load -> check inputs -> export -> passes -> [precision | int8, fp8 Q/DQ] -> [op library] -> [TensorRT engine]
-> [AOTInductor packages, fp8's among them] -> validate -> [auto-fix] -> report -> bundle (see DESIGN.md). ``STEPS``
lists the steps in order, each with the condition under which it runs; the state they share is
:class:`~deploykit.conversion.state.ConversionState`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch

from deploykit.backends.onnxruntime.loader import OpLibrary, find_op_library
from deploykit.backends.onnxruntime.runner import OnnxRuntimeRunner
from deploykit.backends.torch.runner import TorchRunner
from deploykit.bundle import trust
from deploykit.bundle import write as bundle
from deploykit.bundle.format import MODEL, REFERENCE_MODEL, REPORT, REPORT_PAGE
from deploykit.bundle.manifest import build_manifest, native_files, tensor_spec
from deploykit.bundle.read import open_bundle
from deploykit.conversion import aoti, fp8, openvino
from deploykit.conversion.engine import build_tensorrt_stage
from deploykit.conversion.export import check_program_batch, export_onnx
from deploykit.conversion.loading import LoadedModel, load_model
from deploykit.conversion.options import ConvertOptions
from deploykit.conversion.precision import PrecisionStage
from deploykit.conversion import quantize, quantize_fix
from deploykit.conversion.report import build_report
from deploykit.conversion.state import ConversionState
from deploykit.errors import BadInputError, DeployKitError, error_summary
from deploykit.ops import custom_op_types
from deploykit.passes import run_passes
from deploykit.passes.ort_fusions import ort_only_ops
from deploykit.passes.precision import LOW_TYPES, check_precision
from deploykit.report import render_html
from deploykit.specs import BatchRange, InputSpec
from deploykit.validation.compare import parse_tolerances
from deploykit.validation.inputs import batch_size, load_feeds, random_feeds
from deploykit.validation.validate import CandidateValidation, Remembered, validate
from deploykit.versions import tool_versions


@dataclasses.dataclass
class ConvertResult:
    out_dir: Path
    report: dict
    validations: list[CandidateValidation]

    @property
    def passed(self) -> bool:
        return self.report["verdict"] == "pass"

    @property
    def inconclusive(self) -> bool:
        """The bundle matches PyTorch, but some output does not depend on the input (docs/validation.md)."""
        return self.report["verdict"] == "inconclusive"


def _no_stage(_title: str):
    return contextlib.nullcontext()


def convert(options: ConvertOptions, stage=_no_stage) -> ConvertResult:
    """Convert, validate and bundle a model. ``stage(title)`` wraps each step (progress display)."""
    bundle.prepare_destination(Path(options.output).absolute(), options.force)
    quantize.check_options(options)
    fp8.check_options(options)
    openvino.check_options(options)
    if not options.quantizes_graph:
        check_precision(options.graph_precision, options.io_precision, options.auto_fix)
    state = ConversionState(options)
    for step in STEPS:
        if step.runs_when(state):
            with stage(step.title.format(options=options)):
                step.run(state)
    return ConvertResult(Path(options.output).absolute(), state.report, state.validations)


def _always(_state: ConversionState) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Step:
    """A step of the pipeline. ``runs_when`` is asked when the step's turn comes, so it sees what
    the earlier steps found (custom ops in the graph, a failed validation)."""

    title: str  # shown as progress; ``{options.NAME}`` is filled in from the ConvertOptions
    run: Callable[[ConversionState], None]
    runs_when: Callable[[ConversionState], bool] = _always


def _load(state: ConversionState) -> None:
    options = state.options
    state.loaded = load_model(options.model, options.factory, options.trust_pickle)
    aoti.check_source(state.loaded, options.backend, options.aoti_shapes)
    if options.precision == "fp8" and not options.quantizes_graph:
        fp8.check_source(state.loaded.kind)
    if state.loaded.program is not None:
        check_program_batch(state.loaded.program, options.batch)
    state.specs = resolve_input_specs(state.loaded, options.inputs, options.batch)


def _run_reference(state: ConversionState) -> None:
    state.reference = Remembered(TorchRunner(state.loaded, [spec.name for spec in state.specs]))
    state.example = _example_inputs(state.specs, state.options.batch)
    _probe(state.reference, state.example, state.specs)
    state.feed_sets = _validation_feeds(state.specs, state.options)
    if state.options.precision in ("int8", "fp8"):  # a bad --calibration file stops here, before the export
        state.calibration = quantize.Calibration.read(state.options, state.specs)


def _export(state: ConversionState) -> None:
    options = state.options
    example = {name: torch.from_numpy(array) for name, array in state.example.items()}
    state.exported = export_onnx(state.loaded, example, state.reference.output_names, options.batch,
                                 options.opset, options.exporter)


def _optimize(state: ConversionState) -> None:
    options = state.options
    state.optimized, state.pass_stats = run_passes(state.exported.model, custom_ops=options.custom_ops,
                                                   ort_fusions=options.ort_fusions,
                                                   quantizable=options.quantizes_graph)


def _optimize_portable(state: ConversionState) -> None:
    state.portable, _ = run_passes(state.exported.model, custom_ops=state.options.custom_ops, ort_fusions=False)


def _write_precision(state: ConversionState) -> None:
    options = state.options
    state.precision = PrecisionStage.start(state.optimized, options.graph_precision, options.io_precision,
                                           state.example)
    state.typed = state.precision.model
    if _tensorrt_requested(state):
        graph = state.portable if state.portable is not None else state.optimized
        state.engine_precision = PrecisionStage.start(graph, options.precision, options.io_precision,
                                                      state.example, target="tensorrt")


def _quantize(state: ConversionState) -> None:
    """For TensorRT: symmetric int8 (or fp8) of the graph without ONNX Runtime's fused ops, which ONNX Runtime
    validates and ships as well (one quantized graph, so the engine runs what was validated)."""
    options = state.options
    target = "tensorrt" if _tensorrt_requested(state) else "onnxruntime"
    graph = state.portable if target == "tensorrt" and state.portable is not None else state.optimized
    method = quantize.FP8_CALIBRATION_METHOD if options.precision == "fp8" else options.calibration_method
    state.quantization = quantize.QuantizationStage.start(graph, state.calibration, method, target, options.precision)


def _find_op_library(state: ConversionState) -> None:
    state.library = find_op_library()


def _build_engine(state: ConversionState) -> None:
    options = state.options
    state.engine = build_tensorrt_stage(state.engine_graph, state.specs, options.batch, options.trt_targets,
                                        options.trt_workspace_bytes, options.precision)


def _compile_aoti(state: ConversionState) -> None:
    options = state.options
    reason = aoti.skip_reason(state.loaded, options.backend)
    if reason:
        state.aoti = aoti.AotiStage([], {}, reason)
        return
    graph = state.shipped_graph.graph
    io = [tensor_spec(v, options.batch.to_json() if options.batch else None) for v in graph.input], \
        [tensor_spec(v) for v in graph.output]
    sizes = [batch_size(feeds) for feeds in state.feed_sets]
    if options.precision == "fp8" and state.fp8 is None:  # auto-fix compiles again with its own stage
        state.fp8 = fp8.Fp8Stage.start(state.loaded.module, state.calibration)
    state.aoti = aoti.build_aoti_stage(state.loaded, state.specs, io, options.batch, sizes, options.aoti_shapes,
                                       options.precision, state.fp8)


def _build_openvino(state: ConversionState) -> None:
    """The OpenVINO model from the fp32 graph the shipped one was made from (int8: NNCF on the same calibration
    batches), from a graph of standard ops where that one has ours."""
    options = state.options
    source = state.quantization.fp32 if state.quantization is not None else state.optimized
    note = openvino.source_note(source)
    if custom_op_types(source):
        source, _ = run_passes(state.exported.model, custom_ops=False, ort_fusions=options.ort_fusions,
                               quantizable=options.quantizes_graph)
    io = [tensor_spec(v) for v in source.graph.input], [tensor_spec(v) for v in source.graph.output]
    state.openvino = openvino.OpenVinoStage.build(source, io, note, options.precision, state.calibration)


def _validate(state: ConversionState) -> None:
    state.tolerances = parse_tolerances(state.options.tolerances, state.options.precision,
                                        state.reference.output_names)
    candidates = _shipped_candidates(state)
    _check_signature(candidates[_first_onnx_label(candidates)], state.specs, state.reference.output_names)
    _validate_shipped(state, candidates)


def _validate_shipped(state: ConversionState, candidates: dict | None = None) -> None:
    """Validate what the bundle ships (``candidates``, else the current ones) against PyTorch; int8 or fp8
    scales fitted to random data make every output inconclusive, in each round of auto-fix as in the first."""
    state.validations = validate(state.reference, candidates or _shipped_candidates(state), state.feed_sets,
                                 state.tolerances, PLAIN_EXPORT)
    if state.quantized is not None:
        reasons = state.quantized.inconclusive_reasons(state.reference.output_names)
        for validation in state.shipped_validations:
            validation.inconclusive = {**validation.inconclusive, **reasons}


def _auto_fix(state: ConversionState) -> None:
    state.fixed = state.precision.auto_fix(state.reference, state.feed_sets, state.validations[0],
                                           state.tolerances, state.library.path)
    if state.engine_precision is not None:
        state.engine_precision.auto_fix(state.reference, state.feed_sets, state.validations[0], state.tolerances,
                                        state.library.path)
    if state.engine is not None:
        _build_engine(state)
    _validate_shipped(state)


def _auto_fix_int8(state: ConversionState) -> None:
    """Rank the quantized matrix products on the first feeds that failed, then keep the worst 1, 2, 4 ...
    in float until validation passes (``quantize_fix``)."""
    stage, library = state.quantization, state.library.path
    index = next((i for i, run in enumerate(state.validations[0].runs) if not run.passed), 0)
    feeds = state.feed_sets[index]
    ranking = quantize_fix.rank_nodes(stage.fp32, stage.model, feeds, stage.fixable_nodes(), library)
    stage.fix = fix = quantize_fix.QuantizationFix(ranking, quantized_ms=quantize_fix.latency_ms(stage.model, feeds, library))
    unfixed = stage.model, stage.nodes, state.validations, state.openvino
    for size in quantize_fix.round_sizes(len(ranking), quantize_fix.MAX_FLOAT):
        kept = quantize_fix.with_feeding_ops(stage.fp32, [r.node for r in ranking[:size]],
                                             quantize.quantized_ops(stage.precision))
        stage.requantize(kept)
        if state.openvino is not None:
            state.openvino = state.openvino.rebuilt(kept)
        _validate_shipped(state)
        fix.rounds.append(quantize_fix.FixRound(kept, state.passed, quantize_fix.latency_ms(stage.model, feeds, library)))
        if state.passed:
            fix.stopped = f"passed with {len(kept)} node(s) in float"
            return
    # nothing passed: the fully quantized graph ships (as fast as int8 gets, and no worse than the rounds)
    stage.model, stage.nodes, state.validations, state.openvino = unfixed
    kept_products = min(len(ranking), quantize_fix.MAX_FLOAT)
    fix.stopped = (f"still failing with the {kept_products} worst of {len(ranking)} matrix products in float "
                   f"({len(fix.rounds[-1].kept_float)} nodes with the ops that feed them; the bound is {quantize_fix.MAX_FLOAT} "
                   "products; the bundle keeps the fully quantized graph): calibrate on real data (--calibration) or "
                   "convert with --precision fp16"
                   if ranking else "no quantized matrix product to keep in float")


def _auto_fix_fp8(state: ConversionState) -> None:
    """Rank the fp8 layers on the first feeds a package failed, then keep the worst 1, 2, 4 ... in fp16 and
    compile the packages again until validation passes; where none passes, the first packages ship."""
    failed = next(v for v in state.validations if v.label in state.aoti.runners and not v.passed)
    run = next(i for i, run in enumerate(failed.runs) if not run.passed)
    feeds, stage, unfixed = state.feed_sets[run], state.fp8, (state.fp8, state.aoti, state.validations)
    ranking = stage.rank_layers(state.loaded.module, feeds)
    fix = quantize_fix.QuantizationFix(ranking, quantized_ms=_package_ms(state.aoti, failed.label, feeds),
                                       method=fp8.AUTO_FIX_METHOD)
    for size in quantize_fix.round_sizes(len(ranking), quantize_fix.MAX_FLOAT):
        kept = [r.node for r in ranking[:size]]
        state.fp8 = stage.keeping_float(kept)
        _compile_aoti(state)
        _validate_shipped(state)
        fix.rounds.append(quantize_fix.FixRound(kept, state.passed, _package_ms(state.aoti, failed.label, feeds)))
        if state.passed:
            state.fp8.fix, fix.stopped = fix, f"passed with {len(kept)} Linear layer(s) in fp16"
            return
    state.fp8, state.aoti, state.validations = unfixed
    state.fp8.fix = fix
    fix.stopped = (f"still failing with the {len(fix.rounds[-1].kept_float)} worst of {len(ranking)} fp8 layers in "
                   f"fp16 (the bound is {quantize_fix.MAX_FLOAT}; the bundle keeps the first packages): calibrate on "
                   "real data (--calibration) or convert with --precision fp16" if ranking else "no fp8 layer to keep")


def _package_ms(stage: aoti.AotiStage, label: str, feeds: dict) -> float:
    """Median time of one run of the packages ``label`` names on ``feeds`` (host clock, outputs on the host)."""
    return quantize_fix.median_ms(lambda: stage.runners[label].run(feeds))


def _write_bundle(state: ConversionState) -> None:
    state.created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    state.versions = tool_versions()
    state.native = native_files(state)
    state.report = build_report(state)
    digests = {entry["file"]: entry["sha256"] for entry in state.native}  # the copies are not hashed again
    with bundle.staged_bundle(state.options.output, state.options.force, digests) as (staging, manifest):
        onnx.save_model(state.shipped_graph, staging / MODEL)
        if state.reference_graph is not None:
            onnx.save_model(state.reference_graph, staging / REFERENCE_MODEL)
        if state.library.path is not None:
            shutil.copy2(state.library.path, staging / state.library.path.name)
        if state.engine is not None:
            (staging / state.engine.file_name).write_bytes(state.engine.build.engine)
        for package in state.aoti.packages if state.aoti else []:
            shutil.copy2(package.path, staging / package.entry["file"])
        for path in state.openvino.files if state.openvino else []:
            shutil.copy2(path, staging / path.name)
        bundle.write_json(staging / REPORT, state.report)
        (staging / REPORT_PAGE).write_text(render_html(state.report, state.validations))
        manifest.update(build_manifest(state))
    trust.record_written(list(digests.values()))


def _tune(state: ConversionState) -> None:
    """Time and check every backend that runs the written bundle here against the in-memory PyTorch
    model, with the conversion's inputs and tolerances, and record the table in the bundle."""
    from deploykit.tools.bench import resolve_device
    from deploykit.tuning.checking import Reference
    from deploykit.tuning.record import write_tuning
    from deploykit.tuning.tune import TuneSettings, tune

    written = open_bundle(state.options.output)
    reference = Reference(state.reference, "the PyTorch model (fp32, CPU) as validated", state.tolerances)
    state.tuning = tune(written, reference, state.feed_sets, TuneSettings(device=resolve_device("auto")))
    write_tuning(written.path, state.tuning)
    state.report["tuning"] = state.tuning


def _tune_requested(state: ConversionState) -> bool:
    """--tune, on a bundle that passed validation (a failed one is not for running)."""
    return state.options.tune and state.passed


def _reduced_precision(state: ConversionState) -> bool:
    return state.options.graph_precision in LOW_TYPES


def _quantizes_graph(state: ConversionState) -> bool:
    return state.options.quantizes_graph


def _uses_deploykit_ops(state: ConversionState) -> bool:
    return bool(custom_op_types(state.shipped_graph))


def _tensorrt_requested(state: ConversionState) -> bool:
    return state.options.backend in ("tensorrt", "all")


def _aoti_requested(state: ConversionState) -> bool:
    return state.options.backend in ("aoti", "all")


def _openvino_requested(state: ConversionState) -> bool:
    return state.options.backend == "openvino"


def _tensorrt_needs_portable_graph(state: ConversionState) -> bool:
    """TensorRT cannot parse ONNX Runtime's contrib ops: it builds from a graph without them."""
    return _tensorrt_requested(state) and bool(ort_only_ops(state.optimized))


def _auto_fix_can_help(state: ConversionState) -> bool:
    """--auto-fix on a reduced-precision graph that failed; the plain export does not decide it, nor (fp8)
    the packages."""
    packages = state.aoti.runners if state.fp8 is not None else {}
    return (state.precision is not None and state.options.auto_fix
            and any(not v.passed for v in state.shipped_validations if v.label not in packages))


def _fp8_auto_fix_can_help(state: ConversionState) -> bool:
    """--auto-fix where an fp8 package failed (fp16's auto-fix is for the ONNX graph)."""
    return (state.fp8 is not None and state.options.auto_fix
            and any(v.label in state.aoti.runners and not v.passed for v in state.validations))


def _int8_auto_fix_can_help(state: ConversionState) -> bool:
    """--auto-fix on a quantized graph (int8, fp8 for TensorRT) that failed."""
    return state.quantization is not None and state.options.auto_fix and not state.passed


#: What runs, in order, and when. The titles are the CLI's progress lines.
STEPS = (
    Step("Loading the model", _load),
    Step("Running the model in PyTorch", _run_reference),
    Step("Exporting ONNX", _export),
    Step("Optimizing the graph", _optimize),
    Step("Optimizing the graph for TensorRT (without ONNX Runtime's fused ops)", _optimize_portable,
         _tensorrt_needs_portable_graph),
    Step("Writing {options.graph_precision} into the graph", _write_precision, _reduced_precision),
    Step("Quantizing to {options.precision} (ONNX Runtime static quantization)", _quantize, _quantizes_graph),
    Step("Building deploykit's op library (cached after the first run)", _find_op_library, _uses_deploykit_ops),
    Step("Building the TensorRT engine", _build_engine, _tensorrt_requested),
    Step("Compiling AOTInductor packages (C++: slow)", _compile_aoti, _aoti_requested),
    Step("Building the OpenVINO model ({options.precision})", _build_openvino, _openvino_requested),
    Step("Validating against PyTorch", _validate),
    Step("Pinning the nodes that diverge to fp32 (--auto-fix)", _auto_fix, _auto_fix_can_help),
    Step("Keeping the quantized nodes that diverge in float (--auto-fix)", _auto_fix_int8, _int8_auto_fix_can_help),
    Step("Keeping the fp8 layers that diverge in fp16 (--auto-fix)", _auto_fix_fp8, _fp8_auto_fix_can_help),
    Step("Writing the bundle", _write_bundle),
    Step("Timing what runs here (--tune)", _tune, _tune_requested),
)


def _shipped_candidates(state: ConversionState) -> dict:
    graph = f"deploykit graph {state.quantization.precision}" if state.quantization is not None else "deploykit graph"
    candidates = _candidates(state.exported.model, state.shipped_graph, state.library, state.engine,
                             state.precision, state.aoti, graph)
    if state.engine is not None and state.engine.runner is None and state.engine_graph is not state.shipped_graph:
        # The engine cannot run here: the graph it was built from stands in for it.
        candidates = _before_plain_export(candidates, _engine_graph_candidates(state))
    if state.openvino is not None:
        candidates = _before_plain_export(candidates, {state.openvino.label: state.openvino.runner})
    return candidates


def _before_plain_export(candidates: dict, more: dict) -> dict:
    """``more`` candidates among the shipped ones: the plain export stays last."""
    *shipped, plain = candidates.items()
    return dict([*shipped, *more.items(), plain])


def _engine_graph_candidates(state: ConversionState) -> dict:
    library = state.library.path
    if state.engine_precision is not None:
        emulation = state.engine_precision.emulation(library)
        return {f"tensorrt engine's graph {state.options.precision}, rounding emulated per node": emulation}
    return {"tensorrt engine's graph": OnnxRuntimeRunner.from_model(state.engine_graph, library)}


#: The exporter's graph before any pass: tells where a failure comes from, and is a second fp32
#: implementation of the model for validate()'s float64 judgement.
PLAIN_EXPORT = "plain export"


def _candidates(plain: onnx.ModelProto, optimized: onnx.ModelProto, library: OpLibrary, engine,
                precision: PrecisionStage | None = None, aoti_stage: aoti.AotiStage | None = None,
                graph: str = "deploykit graph") -> dict:
    """What validation compares with PyTorch; the first is the bundle as it will run, the AOTInductor
    packages (one candidate per kind: static, dynamic) come after the ONNX graph. ``graph`` labels
    the ONNX graph's candidates."""
    candidates = {}
    if engine is not None and engine.runner is not None:
        candidates["tensorrt engine"] = engine.runner
    if precision is not None:
        candidates.update(precision.candidates(library.path))
    elif library.path is not None:
        candidates[f"{graph} + op library"] = OnnxRuntimeRunner.from_model(optimized, library.path)
        candidates[f"{graph}, ONNX functions"] = OnnxRuntimeRunner.from_model(optimized)
    else:
        candidates[graph] = OnnxRuntimeRunner.from_model(optimized)
    if aoti_stage is not None:
        candidates.update(aoti_stage.runners)
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


def _probe(reference: Remembered, example: dict[str, np.ndarray], specs: list[InputSpec]) -> None:
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
