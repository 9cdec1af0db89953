"""The output bundle: staged in a sibling directory and swapped into place atomically; and the
result files other commands write into a folder (bench, profile, tune), all or none.

A run that fails leaves nothing behind. ``force`` replaces only a deploykit bundle or an empty
directory, and only once the new bundle is complete: at every instant OUT holds the complete
old bundle or the complete new one. On Linux the swap is one ``renameat2(RENAME_EXCHANGE)``;
elsewhere it is two renames, with a marker that lets the next run finish a swap that was cut
short. Every run holds an ``flock`` on the directories it is working in, so the next run cleans
what a killed run left beside OUT but never a directory a live run is still writing.

Both are checked by a probe write before any work (a bad ``-o`` is exit 2), and a full disk while
writing is exit 3 with nothing half-written left.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Callable

from deploykit.bundle.format import FORMAT, MANIFEST, sha256_of
from deploykit.errors import BadInputError, EnvironmentProblem

#: In a retired (``.NAME.*.old``) directory: the name of the staging directory that holds the
#: complete new bundle, written before the old bundle moves aside.
SWAP_MARKER = "complete-bundle"
_STAGING, _RETIRED = ".partial", ".old"
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
_HELD = (signal.SIGINT, signal.SIGTERM)


def prepare_destination(out_dir: Path, force: bool) -> None:
    """Before any work: finish or clean what an interrupted run left beside ``out_dir``, then check it."""
    clean_leftovers(out_dir)
    check_destination(out_dir, force)


def check_destination(out_dir: Path, force: bool) -> None:
    """Fail before any work if the run could not be written where asked, or would destroy data."""
    if out_dir.exists() and not force:
        raise BadInputError(f"{out_dir} already exists; pass --force to replace it, or choose another -o")
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInputError(f"{out_dir} exists and is not a directory; remove it or choose another -o")
    if out_dir.is_dir() and not _replaceable(out_dir):
        raise BadInputError(f"{out_dir} is neither a deploykit bundle nor empty; --force replaces only those, "
                            "so choose another -o (or empty it yourself)")
    if not out_dir.parent.exists():
        raise BadInputError(f"{out_dir.parent} does not exist; create it or choose another -o")
    if not out_dir.parent.is_dir():
        raise BadInputError(f"{out_dir.parent} is not a directory; choose another -o")
    _probe_write(out_dir)


def _replaceable(directory: Path) -> bool:
    """An empty directory, or one whose manifest carries deploykit's format tag."""
    try:
        if not any(directory.iterdir()):
            return True
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def check_results_folder(folder: Path) -> None:
    """Fail before any work if files could not be written into ``folder`` (made with its parents when
    missing): the probe write of :func:`check_destination`, in ``folder`` or the nearest folder above it."""
    folder = folder.absolute()
    existing = next(path for path in (folder, *folder.parents) if os.path.exists(path))  # False where unreadable
    if not existing.is_dir():
        raise BadInputError(f"{existing} is not a directory; choose another -o")
    _probe_write(existing / folder.name)


def _probe_write(out_dir: Path) -> None:
    """Create and remove a directory beside ``out_dir``: what staging will do, tried up front."""
    try:
        with _full_disk_is_environment(lambda reason: f"{out_dir.parent} is on a full disk ({reason}); "
                                                      "free some space or choose another -o"):
            os.rmdir(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".probe", dir=out_dir.parent))
    except OSError as error:
        raise BadInputError(f"cannot write in {out_dir.parent} ({error.strerror}); choose another -o") from None


@contextlib.contextmanager
def staged_bundle(out_dir: Path, force: bool, digests: dict[str, str] | None = None):
    """Yield a staging directory; on success hash its files into the manifest and publish it.

    The caller writes its files and a ``manifest`` dict without ``files``; we add the
    sha256 of every file, write ``manifest.json`` and swap the directory into place.
    ``digests``: the sha256 of files the caller copied in and hashed already, by name.
    """
    digests = digests or {}
    out_dir = Path(out_dir).absolute()
    prepare_destination(out_dir, force)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=_STAGING, dir=out_dir.parent))
    manifest: dict = {}
    try:
        with _locked(staging), _full_disk_is_environment(lambda reason: _staging_full(staging, reason)):
            staging.chmod(0o777 & ~_current_umask())  # mkdtemp makes it private; a bundle is not
            yield staging, manifest
            manifest["files"] = {
                path.name: {"sha256": digests.get(path.name) or sha256_of(path), "bytes": path.stat().st_size}
                for path in sorted(staging.iterdir()) if path.name != MANIFEST
            }
            write_json(staging / MANIFEST, manifest)
            checkpoint("staged")
            _publish(staging, out_dir, force)
    finally:  # our staging directory is unlocked now: cleaned, or swapped in if a swap was cut short
        clean_leftovers(out_dir)


def checkpoint(step: str) -> None:
    """Called between the steps of a publish (``staged``, ``exchanged``, ``retired``, ``published``);
    tests replace it to interrupt a publish at a known point."""


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _locked(directory: Path):
    """Hold an exclusive ``flock`` on ``directory`` (its inode, so it follows renames)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _unless_live(directory: Path):
    """Yield True when no live run holds ``directory``'s lock (and hold it meanwhile)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # gone already
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


@contextlib.contextmanager
def _full_disk_is_environment(message: Callable[[str], str]):
    """A full disk (or quota) in the block is exit 3, ``message(strerror)``: the user's to fix, not our
    bug; any other OSError goes on."""
    try:
        yield
    except OSError as error:
        if error.errno not in _FULL_DISK:
            raise
        raise EnvironmentProblem(message(error.strerror)) from None


def _staging_full(staging: Path, reason: str) -> str:
    """A full disk while staging, with how much had been written when it ran out."""
    staged = sum(path.stat().st_size for path in staging.rglob("*") if path.is_file())
    return (f"the disk of {staging.parent} is full ({reason}) after {staged / 2**20:.1f} MiB of the bundle; "
            "free at least that much more or choose another -o")


def clean_leftovers(out_dir: Path) -> None:
    """Finish or undo a swap a killed run cut short, then remove its staging and retired directories."""
    for retired in sorted(out_dir.parent.glob(f".{out_dir.name}.*{_RETIRED}")):
        with _unless_live(retired) as abandoned:
            if abandoned:
                _finish_swap(retired, out_dir)
                shutil.rmtree(retired, ignore_errors=True)
    for staging in sorted(out_dir.parent.glob(f".{out_dir.name}.*{_STAGING}")):
        with _unless_live(staging) as abandoned:
            if abandoned:
                shutil.rmtree(staging, ignore_errors=True)


def _finish_swap(retired: Path, out_dir: Path) -> None:
    """If OUT is missing, put back the complete bundle: the new one the marker names, else the old."""
    if out_dir.exists():
        return
    marker = retired / SWAP_MARKER
    complete = out_dir.parent / marker.read_text().strip() if marker.is_file() else None
    if complete is not None and (complete / MANIFEST).is_file():
        os.rename(complete, out_dir)
    elif (retired / out_dir.name).is_dir():
        os.rename(retired / out_dir.name, out_dir)


def _publish(staging: Path, out_dir: Path, force: bool) -> None:
    """Move the complete bundle in ``staging`` to ``out_dir``; an old bundle ends up in ``staging``'s
    place (the caller cleans it) or in a retired directory removed here."""
    check_destination(out_dir, force)  # another process may have written it meanwhile
    if not out_dir.exists():
        os.rename(staging, out_dir)
    elif exchange(staging, out_dir):
        checkpoint("exchanged")
    else:
        _two_rename_swap(staging, out_dir)


def exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically with Linux's ``renameat2(RENAME_EXCHANGE)``; False where the
    system or filesystem cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def _two_rename_swap(staging: Path, out_dir: Path) -> None:
    """Old bundle aside, new one in; the marker in the retired directory lets a later run finish."""
    retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=_RETIRED, dir=out_dir.parent))
    try:
        with _locked(retired):
            (retired / SWAP_MARKER).write_text(staging.name)
            with _signals_held():
                os.rename(out_dir, retired / out_dir.name)
                checkpoint("retired")
                try:
                    os.rename(staging, out_dir)
                except OSError:
                    os.rename(retired / out_dir.name, out_dir)
                    raise
            checkpoint("published")
    finally:
        if out_dir.exists():  # else the retired directory's marker is what puts a bundle back
            shutil.rmtree(retired, ignore_errors=True)


@contextlib.contextmanager
def _signals_held():
    """Hold SIGINT and SIGTERM while the block runs (between two renames, while OUT is missing; while
    results land), raising one that arrives again once it is done.

    Python runs its handlers in the main thread, whichever thread took the signal (torch and ONNX
    Runtime start many, so a thread's signal mask holds nothing): there the handlers are swapped for
    ones that take note. Another thread runs the block as it is: no Python handler runs in it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {signum: signal.signal(signum, lambda number, _frame: arrived.append(number)) for signum in _HELD}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)  # its own handler now: KeyboardInterrupt, or the default (exit)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json_text(data))


def json_text(data: dict) -> str:
    """How deploykit writes a JSON file: indented, keys in their order, a final newline."""
    return json.dumps(data, indent=2, sort_keys=False) + "\n"


def replace_files(folder: Path, files: dict[str, str | bytes], written: list[Path] | None = None) -> None:
    """Write ``files`` (name: text or bytes) into ``folder``, made if missing: all of them or none.

    Each goes to a hidden temporary beside its name first, then all are renamed over their names
    with SIGINT and SIGTERM held, each path added to ``written`` as it lands (what the interrupt
    line names). A full disk is exit 3 and, like an interrupt before the renames, leaves the old
    files as they were and no temporary behind.
    """
    contents = {name: data.encode() if isinstance(data, str) else data for name, data in files.items()}
    temporaries: dict[Path, Path] = {}
    try:
        with _full_disk_is_environment(lambda reason: _results_full(folder, contents, reason)):
            folder.mkdir(parents=True, exist_ok=True)
            for name, data in contents.items():
                temporaries[folder / name] = _temporary_copy(folder / name, data)
        with _signals_held():
            for path, temporary in temporaries.items():
                os.replace(temporary, path)
                if written is not None:
                    written.append(path)
    finally:
        for temporary in temporaries.values():
            temporary.unlink(missing_ok=True)


def _temporary_copy(path: Path, data: bytes) -> Path:
    """``data`` in a new hidden file beside ``path``, with the mode ``path`` has (a new file's
    default where it has none); removed again if writing it fails."""
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.chmod(name, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_current_umask())
    except BaseException:
        os.unlink(name)
        raise
    return Path(name)


def _results_full(folder: Path, contents: dict[str, bytes], reason: str) -> str:
    """A full disk while writing results, with the room they need (all of them are in memory)."""
    size = sum(map(len, contents.values())) / 2**20
    return (f"the disk of {folder} is full ({reason}) writing {', '.join(contents)} ({size:.1f} MiB), so none of "
            "them was written; free that much or choose another -o")
