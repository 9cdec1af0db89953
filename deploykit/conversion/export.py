"""torch -> ONNX with torch.onnx: the dynamo exporter by default, TorchScript's as fallback.

TorchScript files can only go through the TorchScript exporter (torch.export cannot trace
a ScriptModule), so ``exporter="auto"`` picks it for them and dynamo for everything else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import traceback
import warnings

import onnx
import torch

from deploykit.errors import BadInputError
from deploykit.conversion.loading import LoadedModel
from deploykit.specs import BatchRange

DEFAULT_OPSET = 18
#: Patterns that name the operator an exporter could not translate, most specific first.
_OPERATOR_PATTERNS = (
    re.compile(r"OpOverload\(op='([\w.:]+)'"),
    re.compile(r"operator '?([\w.]+::[\w.]+)'?"),
    re.compile(r"target=torch\.ops\.([\w.]+)"),
    re.compile(r"\b(aten::\w+|aten\.\w+(?:\.\w+)?)"),
)


@dataclasses.dataclass
class ExportResult:
    model: onnx.ModelProto
    exporter: str
    opset: int
    log: str


def export_onnx(
    loaded: LoadedModel,
    example: dict[str, torch.Tensor],
    output_names: list[str],
    batch: BatchRange | None,
    opset: int = DEFAULT_OPSET,
    exporter: str = "auto",
) -> ExportResult:
    """Export with ``example`` inputs (ordered as the model's arguments)."""
    chosen = _choose_exporter(loaded, exporter)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if chosen == "dynamo":
                model = _export_dynamo(loaded, example, output_names, batch, opset)
            else:
                model = _export_torchscript(loaded, example, output_names, batch, opset)
    except BadInputError:
        raise
    except Exception as error:
        raise _describe_export_failure(error, chosen) from error
    written = next(entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx"))
    if written != opset:
        raise BadInputError(
            f"the {chosen} exporter wrote opset {written}, not the requested {opset}; "
            f"use --opset {written}" + (" or --exporter torchscript" if chosen == "dynamo" else "")
        )
    declare_oldest_ir_version(model)
    return ExportResult(model, chosen, opset, log.getvalue())


def declare_oldest_ir_version(model: onnx.ModelProto) -> None:
    """Declare the oldest IR version that holds the model's opsets, so older runtimes read the file
    (domains onnx does not know, such as deploykit's, ask for none)."""
    oldest = onnx.helper.find_min_ir_version_for(model.opset_import, ignore_unknown=True)
    model.ir_version = min(model.ir_version, oldest)


def _choose_exporter(loaded: LoadedModel, exporter: str) -> str:
    is_script = isinstance(loaded.module, torch.jit.ScriptModule)
    if exporter == "auto":
        return "torchscript" if is_script else "dynamo"
    if exporter == "dynamo" and is_script:
        raise BadInputError(
            "the dynamo exporter cannot trace a TorchScript model; use --exporter torchscript "
            "(or auto), or save the model with torch.export.save"
        )
    if exporter == "torchscript" and loaded.program is not None:
        raise BadInputError(
            "a torch.export program goes through the dynamo exporter; use --exporter dynamo (or auto)"
        )
    return exporter


def _export_dynamo(loaded, example, output_names, batch, opset) -> onnx.ModelProto:
    names = list(example)
    if loaded.program is not None:
        target, args, dynamic_shapes = loaded.program, (), None
    else:
        target, args = loaded.module, tuple(example.values())
        dynamic_shapes = None
        if batch is not None:
            dim = torch.export.Dim("batch", min=batch.min, max=batch.max)
            dynamic_shapes = {name: {0: dim} for name in names}
    program = torch.onnx.export(
        target, args, dynamo=True, input_names=names, output_names=output_names,
        dynamic_shapes=dynamic_shapes, opset_version=opset, verbose=False,
    )
    return program.model_proto


def check_program_batch(program: torch.export.ExportedProgram, batch: BatchRange | None) -> None:
    """A program's batch dimension is fixed at export time: --batch must fit inside it."""
    if batch is None:
        return
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for name in program.graph_signature.user_inputs:
        value = placeholders[name].meta.get("val")
        if value is None or value.dim() == 0:
            continue
        if isinstance(value.shape[0], int):
            raise BadInputError(
                f"the torch.export program fixes input {name}'s batch to {value.shape[0]}, so "
                "--batch cannot make it dynamic; export with dynamic_shapes={..: {0: Dim('batch')}}"
                " or drop --batch"
            )
        allowed = program.range_constraints.get(value.shape[0].node.expr)
        if allowed is not None and not allowed.lower <= batch.min <= batch.max <= allowed.upper:
            raise BadInputError(
                f"--batch {batch.min}:{batch.opt}:{batch.max} exceeds the batch range "
                f"{allowed.lower}..{allowed.upper} the torch.export program was exported with; "
                "narrow --batch or re-export with a wider Dim"
            )


def _export_torchscript(loaded, example, output_names, batch, opset) -> onnx.ModelProto:
    buffer = io.BytesIO()
    dynamic_axes = None
    if batch is not None:
        dynamic_axes = {name: {0: "batch"} for name in [*example, *output_names]}
    torch.onnx.export(
        loaded.module, tuple(example.values()), buffer, dynamo=False,
        input_names=list(example), output_names=output_names, dynamic_axes=dynamic_axes,
        opset_version=opset, do_constant_folding=True,
    )
    return onnx.load_from_string(buffer.getvalue())


def _describe_export_failure(error: Exception, exporter: str) -> BadInputError:
    text = "".join(traceback.format_exception(error))
    operator = next((m.group(1) for p in _OPERATOR_PATTERNS if (m := p.search(text))), None)
    other = "torchscript" if exporter == "dynamo" else "dynamo"
    where = f"at operator {operator}" if operator else _last_exception_line(text)
    return BadInputError(
        f"ONNX export ({exporter} exporter) failed {where}; rewrite that part of the model with "
        f"supported operators, or try --exporter {other} (run with --verbose for details)"
    )


def _last_exception_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line and not line.startswith(" ")]
    return f"with: {lines[-1][:300]}" if lines else ""
