"""What every command shares: the console, error handling, the stage printer, option parsing and options.

Light on purpose (click, rich, deploykit.errors): every command module imports it, and
``deploykit --help`` imports every command module.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from deploykit import errors

#: Progress, tables and messages go to stderr; stdout carries only --json output.
console = Console(stderr=True, highlight=False)

#: An existing bundle directory.
BUNDLE = click.Path(path_type=Path, exists=True, file_okay=False)
#: An existing file (.npz inputs, an ONNX graph, a PyTorch model).
EXISTING_FILE = click.Path(path_type=Path, exists=True, dir_okay=False)


# --------------------------------------------------------------------------- errors and output


@contextlib.contextmanager
def handle_errors(verbose: bool):
    """Turn an exception into one line and its exit code (2, 3 or 4); the traceback only with --verbose.
    A missing onnxruntime (neither deploykit[cpu] nor deploykit[gpu] installed) is exit 3 naming them.

    SIGTERM stops the command as Ctrl-C does: what it was writing is cleaned up on the way out
    (a staged bundle is removed, an old one stays) and it exits 130. It yields a list for the paths
    the command has written (``deploykit.bundle.write.replace_files`` adds them), which the
    interrupt line names: it never says nothing was written when something was.
    """
    if not verbose:  # torch's deprecation chatter is noise to a user converting a model
        warnings.simplefilter("ignore")
    written: list[Path] = []
    try:
        with _sigterm_interrupts():
            yield written
    except errors.DeployKitError as error:
        _fail(str(error), error.exit_code, verbose)
    except KeyboardInterrupt:
        console.print(f"[red]interrupted[/]; {escape(_what_was_written(written))}", soft_wrap=True)
        sys.exit(errors.EXIT_INTERRUPTED)
    except ModuleNotFoundError as error:
        from deploykit.backends.onnxruntime import wheels

        if not wheels.missing_import(error):
            _fail_internal(error, verbose)
        _fail(f"ONNX Runtime is not installed: {wheels.INSTALL}", errors.EXIT_ENVIRONMENT, verbose)
    except Exception as error:  # anything unforeseen is our bug: say so, exit 4
        _fail_internal(error, verbose)


def _what_was_written(written: list[Path]) -> str:
    """What an interrupted command leaves on disk, as it is: a user decides from it what to redo."""
    if not written:
        return "nothing was written"
    return f"{' and '.join(map(str, written))} had been written in full before it, nothing else"


@contextlib.contextmanager
def _sigterm_interrupts():
    """Raise KeyboardInterrupt on SIGTERM while the block runs (signals reach the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


def _fail_internal(error: BaseException, verbose: bool) -> None:
    hint = "" if verbose else " (run with --verbose for the traceback)"
    _fail(f"{type(error).__name__}: {error}{hint}; please report it", errors.EXIT_INTERNAL, verbose)


def _fail(message: str, code: int, verbose: bool) -> None:
    if verbose:
        console.print_exception(show_locals=False)
    prefix = "internal error" if code == errors.EXIT_INTERNAL else "error"
    console.print(f"[bold red]{prefix}:[/] {escape(message)}", soft_wrap=True)  # keeps 'deploykit[gpu]' whole
    sys.exit(code)


def exit_with_verdict(verdict: str) -> None:
    """Exit 0 when the checks passed, 1 when one failed, 5 when they passed but proved nothing
    (``verdict``: pass, fail or inconclusive, as :func:`deploykit.errors.verdict` tells)."""
    sys.exit(errors.VERDICT_EXITS[verdict])


def echo_json(value) -> None:
    """What --json prints, on stdout."""
    click.echo(json.dumps(value, indent=2))


def stage_printer(quiet: bool):
    """A ``stage(title)`` context manager: a spinner while it runs, a timed line when done."""

    @contextlib.contextmanager
    def stage(title: str):
        start = time.perf_counter()
        if quiet:
            yield
            return
        with console.status(f"{title}..."):
            yield
        console.print(f"[green]✓[/] {title} [dim]({time.perf_counter() - start:.1f} s)[/]")

    return stage


# --------------------------------------------------------------------------- option parsing


def parse_with(parser, values, option: str):
    """``parser`` applied to one value or to each of a tuple; its BadInputError becomes click's usage error."""
    try:
        return [parser(v) for v in values] if isinstance(values, tuple) else parser(values)
    except errors.BadInputError as error:
        raise click.BadParameter(str(error), param_hint=option) from None


def parse_keys(text: str | None, keys, option: str) -> set[str] | None:
    """A comma-separated choice among ``keys``; None when not given."""
    if not text:
        return None
    chosen = {part.strip() for part in text.split(",") if part.strip()}
    unknown = chosen - set(keys)
    if unknown:
        raise click.BadParameter(f"unknown {', '.join(sorted(unknown))}; choose from {', '.join(keys)}",
                                 param_hint=option)
    return chosen


# --------------------------------------------------------------------------- shared options


def combine(*decorators):
    """One decorator that applies ``decorators`` in the order listed (the order --help shows)."""

    def apply(function):
        for decorator in reversed(decorators):
            function = decorator(function)
        return function

    return apply


def verbose_option(help_text: str = "Show tracebacks."):
    return click.option("-v", "--verbose", is_flag=True, help=help_text)


def json_option(help_text: str):
    return click.option("--json", "as_json", is_flag=True, help=help_text)


def seed_option(help_text: str = "Seed of the random inputs."):
    return click.option("--seed", type=int, default=0, show_default=True, help=help_text)


def inputs_option(help_text: str):
    """--inputs: an existing .npz of the model's inputs, passed as ``feeds_path``."""
    return click.option("--inputs", "feeds_path", type=EXISTING_FILE, help=help_text)


def allow_failed_option(help_text: str):
    return click.option("--allow-failed", is_flag=True, help=help_text)


#: --factory and --trust-pickle: how the MODEL argument is loaded (convert, validate).
model_loading_options = combine(
    click.option("--factory", metavar="PKG.MODULE:FUNCTION",
                 help="Build the model with this function and load MODEL as its state_dict."),
    click.option("--trust-pickle", is_flag=True,
                 help="Allow a pickled nn.Module (unpickling runs code from the file)."),
)

#: --trust-bundle: consent to run native code the bundle carries (every command that can load it).
trust_bundle_option = click.option(
    "--trust-bundle", is_flag=True,
    help="Load the bundle's native code (op library, engine plugins) even where this machine's deploykit "
         "did not build it.")

#: --tolerance, repeatable: convert's validation rules overridden (convert; validate and tune apply
#: it after the tolerances the bundle was converted with, which its manifest records).
tolerance_option = click.option("--tolerance", "tolerances", multiple=True, metavar="[OUTPUT:]KEY=VALUE,...",
                                help="Override atol, rtol, min_cosine or min_top1, for all outputs or one (validate, "
                                     "tune: after the bundle's own).")
