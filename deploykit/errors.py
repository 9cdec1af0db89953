"""Errors a user can act on, each tied to the CLI exit code it produces.

Every error carries one line that names the problem and the fix; the CLI prints
that line alone (the traceback only with ``--verbose``).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_VALIDATION_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_ENVIRONMENT = 3
EXIT_INTERNAL = 4


class DeployKitError(Exception):
    """Base class: ``str(error)`` is the one-line message shown to the user."""

    exit_code = EXIT_INTERNAL


class BadInputError(DeployKitError):
    """The model file, an input spec or an option is wrong (exit 2)."""

    exit_code = EXIT_BAD_INPUT


class EnvironmentProblem(DeployKitError):
    """A runtime, toolchain or library this step needs is missing (exit 3)."""

    exit_code = EXIT_ENVIRONMENT


class ValidationFailed(DeployKitError):
    """The converted model does not reproduce the reference within tolerance (exit 1)."""

    exit_code = EXIT_VALIDATION_FAILED
