"""Errors a user can act on, each tied to the CLI exit code it produces.

Every error carries one line that names the problem and the fix; the CLI prints
that line alone (the traceback only with ``--verbose``).
"""

from __future__ import annotations

import re

EXIT_OK = 0
EXIT_VALIDATION_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_ENVIRONMENT = 3
EXIT_INTERNAL = 4
#: The bundle matches PyTorch, but an output does not depend on the validation inputs (constant
#: or all zeros: random weights, a zero-initialised layer), so matching it proves nothing.
EXIT_VALIDATION_INCONCLUSIVE = 5
#: SIGINT or SIGTERM stopped the command (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130
#: What a check concludes (the "verdict" of convert's report and of ``deploykit validate``), and its exit code.
VERDICT_EXITS = {"pass": EXIT_OK, "fail": EXIT_VALIDATION_FAILED, "inconclusive": EXIT_VALIDATION_INCONCLUSIVE}


def verdict(passed: bool, inconclusive: bool = False) -> str:
    """pass, fail, or inconclusive: it passed, but an output does not depend on the inputs."""
    return "fail" if not passed else "inconclusive" if inconclusive else "pass"


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


def with_reason(reasons: str, error: BaseException, prefix: str = "") -> str:
    """``reasons`` (a "; "-joined list, maybe empty) with ``error``'s summary added after ``prefix``:
    why a timed backend broke, beside what was already said of it (bench and tune)."""
    return "; ".join(filter(None, [reasons, prefix + error_summary(error)[:300]]))


def error_summary(error: BaseException) -> str:
    """The line of a library's error that says what went wrong.

    Prefers the last ``SomeError: message`` line, since TorchScript and torch.export put
    the cause after their own tracebacks; otherwise the first line.
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in reversed(lines):
        if match := re.match(r"^\w*(?:Error|Exception): (.+)", line):
            return match.group(1)
    return lines[0] if lines else type(error).__name__
