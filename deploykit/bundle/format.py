"""What makes a directory a deploykit bundle: the manifest's name, its format tag and version,
the names of the files convert writes, and how a file is fingerprinted in the manifest."""

from __future__ import annotations

import hashlib
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = "deploykit-bundle"
#: Bumped when a reader of an older version could misread a bundle; readers refuse newer ones.
FORMAT_VERSION = 1

#: The graph that ships (the manifest's ``model``).
MODEL = "model.onnx"
#: The fp32 graph a reduced-precision bundle was typed from: the reference of ``deploykit debug``.
REFERENCE_MODEL = "model.fp32.onnx"
REPORT = "report.json"
REPORT_PAGE = "report.html"


def sha256_of(path: Path) -> str:
    """The digest the manifest records for each file, checked before the file is used."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


#: sha256 by (path, size, mtime, ctime): files hashed again and again in one process.
_DIGESTS: dict[tuple, str] = {}


def cached_sha256(path: Path) -> str:
    """``sha256_of`` a file this process hashes again and again (the build cache's libraries, checked
    on every provenance question): hashed again only when its size or times change."""
    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = sha256_of(Path(path))
    return _DIGESTS[key]
