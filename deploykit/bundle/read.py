"""The one way to open a bundle: its manifest checked, its files checked against what deploykit validated.

Apart from the runners so that doctor, inspect and debug can read a bundle without a backend.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from deploykit.bundle.format import FORMAT, FORMAT_VERSION, MANIFEST, MODEL, sha256_of
from deploykit.errors import BadInputError, EnvironmentProblem, ValidationFailed


@dataclasses.dataclass
class Bundle:
    """A bundle directory and its manifest; a file is checked against its sha256 when first used."""

    path: Path
    manifest: dict
    _verified: set = dataclasses.field(default_factory=set, repr=False)

    @property
    def inputs(self) -> list[dict]:
        return self.manifest["inputs"]

    @property
    def outputs(self) -> list[dict]:
        return self.manifest["outputs"]

    @property
    def model(self) -> str:
        """File name of the graph that ships."""
        return self.manifest.get("model", MODEL)

    @property
    def precision(self) -> str:
        return self.manifest.get("precision", "fp32")

    @property
    def engines(self) -> list[dict]:
        return self.manifest.get("engines", [])

    @property
    def op_library(self) -> dict | None:
        return next((e for e in self.manifest.get("custom_op_libraries", []) if e["runtime"] == "onnxruntime"), None)

    @property
    def passed(self) -> bool:
        return bool(self.manifest.get("validation", {}).get("passed"))

    def recorded_version(self, *names: str) -> str | None:
        versions = self.manifest.get("versions", {})
        return next((versions[n] for n in names if n in versions), None)

    def file(self, name: str, verify: bool = True) -> Path:
        """Path of a bundle file, refused when it is missing or differs from what was validated."""
        path = self.path / name
        entry = self.manifest.get("files", {}).get(name)
        if entry is None:
            raise BadInputError(f"{name} is not listed in {self.path / MANIFEST}: the bundle is damaged; "
                                "re-run deploykit convert")
        if not path.is_file():
            raise BadInputError(f"{path} is missing: the bundle is incomplete; re-run deploykit convert")
        if verify and name not in self._verified:
            if sha256_of(path) != entry["sha256"]:
                raise BadInputError(f"{path} differs from the file deploykit validated (sha256 mismatch with "
                                    "manifest.json): it was changed after conversion; restore it or re-run deploykit convert")
            self._verified.add(name)
        return path

    def file_problems(self) -> dict[str, str]:
        """Each listed file that is missing or changed since conversion: name -> what is wrong."""
        problems = {}
        for name in self.manifest.get("files", {}):
            try:
                self.file(name)
            except BadInputError as error:
                problems[name] = "missing" if "missing" in str(error) else "sha256 mismatch"
        return problems


def read_manifest(bundle: str | Path) -> dict:
    """The manifest as written, unchecked: :func:`open_bundle` is what readers of a bundle call."""
    path = Path(bundle) / MANIFEST
    if not path.exists():
        raise BadInputError(f"{bundle} is not a deploykit bundle (no {MANIFEST}); run deploykit convert first")
    return json.loads(path.read_text())


def open_bundle(path: str | Path) -> Bundle:
    """Read a bundle's manifest; refuse directories that are not bundles or are too new for us."""
    manifest = read_manifest(path)
    if manifest.get("format") != FORMAT:
        raise BadInputError(f"{path}/manifest.json is not a deploykit bundle manifest; run deploykit convert")
    if int(manifest.get("format_version", 0)) > FORMAT_VERSION:
        raise EnvironmentProblem(f"{path} was written by a newer deploykit (bundle format "
                                 f"{manifest['format_version']}, this one reads {FORMAT_VERSION}): pip install -U deploykit")
    return Bundle(Path(path).absolute(), manifest)


def check_validation(bundle: Bundle, allow_failed: bool) -> None:
    """A bundle whose validation failed runs only on request: its outputs are known to be wrong."""
    if not bundle.passed and not allow_failed:
        raise ValidationFailed(f"{bundle.path} failed validation against PyTorch (see its report.html); "
                               "fix the conversion, or pass allow_failed=True (--allow-failed) to run it anyway")


def version_tuple(text: str) -> tuple[int, ...]:
    """Numeric parts of a version, for comparisons: "1.32.0+cu130" -> (1, 32, 0)."""
    parts = []
    for part in text.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)
