"""Load a state_dict (or a training checkpoint holding one) into the model a factory built,
exactly as ``model.load_state_dict(state)`` would in the user's own script.

That means keeping the state_dict's ``_metadata``: it holds each module's ``_version``, which
``_load_from_state_dict`` reads to upgrade old checkpoints (BatchNorm's ``num_batches_tracked``)
and which some modules require (torchvision's MNASNet refuses a state without it). Keys are
checked strictly; what does not fit is named, as a user error.
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch

from deploykit.errors import BadInputError

_CHECKPOINT_KEYS = ("state_dict", "model_state_dict", "model")
_SHOWN = 4


def state_dict_of(obj, path: Path) -> collections.OrderedDict:
    """The state_dict in ``obj`` (a bare one, or a checkpoint that nests one), without the
    ``module.`` prefixes DataParallel/DDP add, its metadata kept."""
    if isinstance(obj, dict):
        nested = next((obj[key] for key in _CHECKPOINT_KEYS if isinstance(obj.get(key), dict)), None)
        obj = obj if nested is None else nested
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise BadInputError(
            f"{path} is not a state_dict (a dict of tensors, or a checkpoint with 'state_dict'); "
            "save one with torch.save(model.state_dict(), path)"
        )
    return _without_parallel_prefix(obj)


def _without_parallel_prefix(state: dict) -> collections.OrderedDict:
    """Strip ``module.`` from tensor names and from the metadata's module paths alike, so that
    each module still finds its own version (the wrapper's own entry gives way to the model's)."""
    stripped = collections.OrderedDict((_strip_parallel_prefix(k), v) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        stripped._metadata = collections.OrderedDict(
            (_strip_parallel_prefix(path), entry) for path, entry in metadata.items()
        )
    return stripped


def _strip_parallel_prefix(name: str) -> str:
    """``module.layer1.weight`` -> ``layer1.weight``; the wrapped model's path ``module`` -> ``""``."""
    while name == "module" or name.startswith("module."):
        name = name[len("module.") :]
    return name


def load_into(module: torch.nn.Module, state: dict, weights: Path, factory: str) -> None:
    """``module.load_state_dict(state)`` with its strict key check, each failure a user error.

    ``strict=False`` only to read the key lists for our message: torch checks keys the same
    way either way and differs only in raising.
    """
    fix = f"check that {factory} builds the architecture {weights} was saved from"
    try:
        result = module.load_state_dict(state, strict=False)
    except Exception as error:  # size mismatches, or a module's own _load_from_state_dict refusing
        raise BadInputError(f"{weights} does not load into the model built by {factory}: "
                            f"{_load_error_details(error)}; {fix}") from error
    problems = _listed("missing", result.missing_keys) + _listed("unexpected", result.unexpected_keys)
    if problems:
        raise BadInputError(
            f"{weights} does not fit the model built by {factory}: {'; '.join(problems)}; {fix}"
        )


def _listed(kind: str, keys: list[str]) -> list[str]:
    if not keys:
        return []
    more = f" (+{len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else ""
    noun = "key" if len(keys) == 1 else "keys"
    return [f"{len(keys)} {kind} {noun}: {', '.join(keys[:_SHOWN])}{more}"]


def _load_error_details(error: Exception) -> str:
    """torch's ``Error(s) in loading state_dict for X:`` header dropped, its items on one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if lines and lines[0].startswith("Error(s) in loading state_dict"):
        lines = lines[1:]
    more = f" (+{len(lines) - _SHOWN} more)" if len(lines) > _SHOWN else ""
    return " ".join(lines[:_SHOWN]) + more if lines else type(error).__name__
