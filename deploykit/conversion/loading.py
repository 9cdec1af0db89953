"""Load a model file into something we can run and export, and check it is fit for inference.

Formats: TorchScript (``torch.jit.save``), ``torch.export`` programs (``.pt2``), a factory
plus a state_dict, and a whole pickled ``nn.Module`` -- the last only with ``trust_pickle``,
because unpickling runs code from the file.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pickle
import sys
import zipfile
from pathlib import Path

import torch

from deploykit.conversion.checkpoint import load_into, state_dict_of
from deploykit.errors import BadInputError, error_summary

_RESAVE_HINT = "save it with torch.jit.save, torch.export.save or torch.save"
_BATCH_NORM_NAMES = {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm"}


@dataclasses.dataclass
class LoadedModel:
    """A model ready for export: ``module`` runs in eval mode on CPU tensors.

    ``kind`` is ``torchscript``, ``exported_program`` or ``module``; ``program`` holds
    the ``torch.export.ExportedProgram`` for the second kind (its graph is what we export).
    """

    module: torch.nn.Module
    kind: str
    source: Path
    input_names: list[str]
    program: torch.export.ExportedProgram | None = None


def load_model(
    path: str | Path, factory: str | None = None, trust_pickle: bool = False
) -> LoadedModel:
    path = Path(path)
    _check_readable(path)
    if factory:
        loaded = LoadedModel(_build_from_factory(factory, path), "module", path, [])
    else:
        loaded = _load_archive(path, trust_pickle)
    if loaded.kind != "exported_program":
        loaded.module.eval()
        loaded.input_names = _forward_argument_names(loaded.module)
    check_inference_ready(loaded)
    return loaded


def _check_readable(path: Path) -> None:
    if not path.exists():
        raise BadInputError(f"model file {path} does not exist; check the path")
    if path.is_dir():
        raise BadInputError(f"{path} is a directory; pass the model file inside it")
    if path.stat().st_size == 0:
        raise BadInputError(f"model file {path} is empty (0 bytes); {_RESAVE_HINT}")


def _archive_kind(path: Path) -> str:
    """Tell the three zip-based formats apart by the records torch writes into each."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise BadInputError(
            f"{path} is not a readable PyTorch archive (truncated or corrupt: {error}); "
            f"{_RESAVE_HINT}"
        ) from None
    if bad is not None:
        raise BadInputError(f"{path} is corrupt (record {bad} fails its checksum); {_RESAVE_HINT}")
    tails = {name.split("/", 1)[-1] for name in names}
    if "archive_format" in tails or "models/model.json" in tails:
        return "exported_program"
    if "constants.pkl" in tails or any(t.startswith("code/") for t in tails):
        return "torchscript"
    if "data.pkl" in tails:
        return "pickle"
    raise BadInputError(f"{path} is a zip file but not one torch writes; {_RESAVE_HINT}")


def _load_archive(path: Path, trust_pickle: bool) -> LoadedModel:
    if not zipfile.is_zipfile(path):
        raise BadInputError(
            f"{path} is not a PyTorch model file (no TorchScript, torch.export or torch.save "
            f"archive; it may be truncated); {_RESAVE_HINT}"
        )
    kind = _archive_kind(path)
    if kind == "torchscript":
        return LoadedModel(_guarded(torch.jit.load, path, map_location="cpu"), kind, path, [])
    if kind == "exported_program":
        program = _guarded(torch.export.load, path)
        names = list(program.graph_signature.user_inputs)
        return LoadedModel(program.module(), kind, path, names, program)
    obj = _load_pickle(path, trust_pickle)
    if not isinstance(obj, torch.nn.Module):
        raise BadInputError(
            f"{path} holds a {type(obj).__name__} (a state_dict or checkpoint?), not a model; "
            "pass --factory package.module:function to build the model and load it into that"
        )
    return LoadedModel(obj.float().cpu(), "module", path, [])


def _guarded(loader, path: Path, **kwargs):
    try:
        return loader(str(path), **kwargs)
    except Exception as error:  # torch raises many kinds for a damaged file
        raise BadInputError(
            f"cannot load {path}: {error_summary(error)}; the file may be truncated; {_RESAVE_HINT}"
        ) from error


def _load_pickle(path: Path, trust_pickle: bool):
    """Load a torch.save file; arbitrary objects only when the user trusts the file. A zip-format
    file (torch.save's default since 1.6) is memory-mapped: its tensors are copied into the model
    once, not read into memory first (a 2.6 GB checkpoint: 7 s -> 0.2 s here)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as error:
        if trust_pickle:
            raise BadInputError(f"cannot unpickle {path}: {error_summary(error)}") from error
        raise BadInputError(
            f"{path} is a pickled object (e.g. a whole nn.Module); unpickling runs code from the "
            "file, so it was not loaded; pass --trust-pickle if you trust its source, or "
            "save the model with torch.jit.save / torch.export.save instead"
        ) from None
    except Exception as error:
        raise BadInputError(f"cannot load {path}: {error_summary(error)}; {_RESAVE_HINT}") from error


def _build_from_factory(factory: str, weights: Path) -> torch.nn.Module:
    module = convert_sync_batch_norm(_call_factory(factory))
    state = state_dict_of(_load_pickle(weights, trust_pickle=False), weights)
    load_into(module, state, weights, factory)
    return module.float().cpu()


def _call_factory(factory: str) -> torch.nn.Module:
    module_name, sep, function_name = factory.partition(":")
    if not sep or not module_name or not function_name:
        raise BadInputError(f"--factory {factory!r} is not package.module:function")
    if "" not in sys.path:
        sys.path.insert(0, "")  # let users name a module in the current directory
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise BadInputError(f"--factory {factory!r}: {error_summary(error)}; check the name") from error
    module = function()
    if not isinstance(module, torch.nn.Module):
        raise BadInputError(
            f"--factory {factory!r} returned a {type(module).__name__}, not a torch.nn.Module"
        )
    return module


class _AnyRankBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Stands in for SyncBatchNorm, which does not know its input's rank."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-D input (got {input.dim()}-D input)")


def convert_sync_batch_norm(module: torch.nn.Module) -> torch.nn.Module:
    """Replace every SyncBatchNorm (a distributed-training module) by a plain BatchNorm."""
    if isinstance(module, torch.nn.SyncBatchNorm):
        replacement = _AnyRankBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine,
            module.track_running_stats,
        )
        replacement.load_state_dict(module.state_dict())
        return replacement
    for name, child in module.named_children():
        setattr(module, name, convert_sync_batch_norm(child))
    return module


def _forward_argument_names(module: torch.nn.Module) -> list[str]:
    if isinstance(module, torch.jit.ScriptModule):
        return [arg.name for arg in module.forward.schema.arguments[1:]]
    parameters = inspect.signature(module.forward).parameters.values()
    return [
        p.name for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]


def count_batch_norms(loaded: LoadedModel) -> int:
    """BatchNorm layers in the PyTorch model, to show how many the exporter already folded."""
    if loaded.program is not None:
        return sum("batch_norm" in str(node.target) for node in loaded.program.graph.nodes)
    return sum(_is_batch_norm(child) for child in loaded.module.modules())


def _is_batch_norm(module: torch.nn.Module) -> bool:
    kind = getattr(module, "original_name", type(module).__name__)
    return kind in _BATCH_NORM_NAMES or isinstance(module, torch.nn.modules.batchnorm._BatchNorm)


def check_inference_ready(loaded: LoadedModel) -> None:
    """Refuse what would export wrongly: BN without running stats, train-mode BN, NaN/Inf."""
    if loaded.program is not None:
        _check_program_in_eval_mode(loaded.program)
        tensors = {**loaded.program.state_dict, **loaded.program.constants}
    else:
        _check_batch_norm_statistics(loaded.module)
        tensors = dict(loaded.module.state_dict())
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            if not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise BadInputError(
                    f"weight {name} holds {bad} NaN/Inf values; the checkpoint is damaged or "
                    "training diverged: re-export from a healthy checkpoint"
                )


def _check_batch_norm_statistics(module: torch.nn.Module) -> None:
    for name, child in module.named_modules():
        if _is_batch_norm(child):
            if getattr(child, "running_mean", None) is None or getattr(child, "running_var", None) is None:
                raise BadInputError(
                    f"BatchNorm {name or '<root>'} has no running statistics "
                    "(track_running_stats=False), so inference would use batch statistics; "
                    "re-train with track_running_stats=True or estimate the statistics first"
                )


def _check_program_in_eval_mode(program: torch.export.ExportedProgram) -> None:
    for node in program.graph.nodes:
        target = str(node.target)
        training = (
            "_native_batch_norm_legit_functional" in target
            or ("aten.batch_norm" in target and len(node.args) > 5 and node.args[5] is True)
        )
        if training:
            raise BadInputError(
                "the torch.export program was exported in training mode (BatchNorm uses batch "
                "statistics); call model.eval() before torch.export.export and save it again"
            )
