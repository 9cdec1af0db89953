"""The output bundle: written into a temporary sibling directory and renamed into place.

A run that fails leaves nothing behind, and an existing bundle is replaced only when the
caller passes ``force`` -- and then only once the new one is complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from deploykit.bundle.format import MANIFEST, sha256_of
from deploykit.errors import BadInputError


def check_destination(out_dir: Path, force: bool) -> None:
    """Fail before any work if the run could not be written where asked."""
    if out_dir.exists() and not force:
        raise BadInputError(f"{out_dir} already exists; pass --force to replace it, or choose another -o")
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInputError(f"{out_dir} exists and is not a directory; remove it or choose another -o")
    if not out_dir.parent.exists():
        raise BadInputError(f"{out_dir.parent} does not exist; create it or choose another -o")


@contextlib.contextmanager
def staged_bundle(out_dir: Path, force: bool):
    """Yield a staging directory; on success hash its files into the manifest and publish it.

    The caller writes its files and a ``manifest`` dict without ``files``; we add the
    sha256 of every file, write ``manifest.json`` and rename the directory into place.
    """
    out_dir = Path(out_dir).absolute()
    check_destination(out_dir, force)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    staging.chmod(0o777 & ~_current_umask())  # mkdtemp makes it private; a bundle is not
    manifest: dict = {}
    try:
        yield staging, manifest
        manifest["files"] = {
            path.name: {"sha256": sha256_of(path), "bytes": path.stat().st_size}
            for path in sorted(staging.iterdir()) if path.name != MANIFEST
        }
        write_json(staging / MANIFEST, manifest)
        _publish(staging, out_dir, force)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _publish(staging: Path, out_dir: Path, force: bool) -> None:
    """Rename ``staging`` to ``out_dir``; an old bundle moves aside first and goes last."""
    check_destination(out_dir, force)  # another process may have written it meanwhile
    retired = None
    if out_dir.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
        os.rename(out_dir, retired / out_dir.name)
    try:
        os.rename(staging, out_dir)
    except OSError:
        if retired is not None:
            os.rename(retired / out_dir.name, out_dir)
        raise
    finally:
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
