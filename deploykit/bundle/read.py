"""The one way to open a bundle: its manifest checked, its files checked against what deploykit validated.

Apart from the runners so that doctor, inspect and debug can read a bundle without a backend.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pydantic

from deploykit.bundle import paths, schema
from deploykit.bundle.format import FORMAT, FORMAT_VERSION, MANIFEST, MODEL, sha256_of
from deploykit.errors import BadInputError, EnvironmentProblem, ValidationFailed, error_summary


@dataclasses.dataclass
class Bundle:
    """A bundle directory and its manifest; a file is checked against its sha256 when first used."""

    path: Path
    manifest: dict
    _verified: set = dataclasses.field(default_factory=set, repr=False)
    _contained: set = dataclasses.field(default_factory=set, repr=False)  # graphs whose external data stays inside

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
    def aoti(self) -> list[dict]:
        """The AOTInductor packages (the manifest's ``aoti`` entries)."""
        return self.manifest.get("aoti", [])

    @property
    def openvino(self) -> list[dict]:
        """The OpenVINO models (the manifest's ``openvino`` entries)."""
        return self.manifest.get("openvino", [])

    @property
    def op_library(self) -> dict | None:
        return next((e for e in self.manifest.get("custom_op_libraries", []) if e["runtime"] == "onnxruntime"), None)

    @property
    def tolerances(self) -> list[str]:
        """The --tolerance texts the bundle was validated with (older bundles: none recorded)."""
        return list(self.manifest.get("validation", {}).get("tolerances", []))

    @property
    def passed(self) -> bool:
        return bool(self.manifest.get("validation", {}).get("passed"))

    def recorded_version(self, *names: str) -> str | None:
        versions = self.manifest.get("versions", {})
        return next((versions[n] for n in names if n in versions), None)

    def file(self, name: str, verify: bool = True) -> Path:
        """Path of a bundle file, refused when it is missing, leads out of the bundle or differs
        from what was validated; an ONNX graph is refused when its external data lies outside."""
        path = self.path / name
        entry = self.manifest.get("files", {}).get(name)
        if entry is None:
            raise BadInputError(f"{name} is not listed in {self.path / MANIFEST}: the bundle is damaged; "
                                "re-run deploykit convert")
        if not paths.inside(path, self.path):
            raise FileProblem("outside the bundle", f"{path} leads outside the bundle (to {path.resolve()}): "
                              "refused; replace the link with the file itself or re-run deploykit convert")
        if not path.is_file():
            raise FileProblem("missing", f"{path} is missing: the bundle is incomplete; re-run deploykit convert")
        if verify and name not in self._verified:
            if sha256_of(path) != entry["sha256"]:
                raise FileProblem("sha256 mismatch", f"{path} differs from the file deploykit validated (sha256 "
                                  "mismatch with manifest.json): it was changed after conversion; restore it or "
                                  "re-run deploykit convert")
            self._verified.add(name)
        if path.suffix == ".onnx" and name not in self._contained:
            if outside := paths.external_data_outside(path, self.path):  # parses the graph: once per name
                raise FileProblem("external data outside the bundle", f"{path} reads external data from {outside}, "
                                  "outside the bundle: refused; re-run deploykit convert")
            self._contained.add(name)
        return path

    def file_problems(self) -> dict[str, str]:
        """Each listed file that is missing, outside or changed since conversion: name -> what is wrong."""
        problems = {}
        for name in self.manifest.get("files", {}):
            try:
                self.file(name)
            except FileProblem as error:
                problems[name] = error.kind
        return problems


class FileProblem(BadInputError):
    """A bundle file that cannot be used; ``kind`` is the short form ``inspect`` and ``doctor`` print."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def read_manifest(bundle: str | Path) -> dict:
    """The manifest as written, parsed but unchecked: :func:`open_bundle` is what readers of a bundle call."""
    path = Path(bundle) / MANIFEST
    if not path.exists():
        raise BadInputError(f"{bundle} is not a deploykit bundle (no {MANIFEST}); run deploykit convert first")
    if not paths.inside(path, Path(bundle)):
        raise BadInputError(f"{path} leads outside the bundle (to {path.resolve()}): refused; re-run deploykit convert")
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise BadInputError(f"{path}: cannot read it ({error.strerror}); re-run deploykit convert") from None
    except (ValueError, RecursionError) as error:  # JSONDecodeError, bad UTF-8, too deep
        raise BadInputError(f"{path} is not valid JSON ({error_summary(error)}); re-run deploykit convert") from None


def open_bundle(path: str | Path) -> Bundle:
    """Read a bundle's manifest and check it against the schema; refuse directories that are not
    bundles, manifests too new for us, and any field of the wrong type or a file outside the bundle."""
    manifest = read_manifest(path)
    where = Path(path) / MANIFEST
    if not isinstance(manifest, dict):
        raise BadInputError(f"{where} holds a JSON {type(manifest).__name__}, not an object: "
                            "it is not a deploykit bundle manifest; re-run deploykit convert")
    if manifest.get("format") != FORMAT:
        raise BadInputError(f"{path}/manifest.json is not a deploykit bundle manifest; run deploykit convert")
    version = _checked(schema.Header, manifest, where).format_version
    if version > FORMAT_VERSION:
        raise EnvironmentProblem(f"{path} was written by a newer deploykit (bundle format "
                                 f"{version}, this one reads {FORMAT_VERSION}): pip install -U deploykit")
    _checked(schema.Manifest, manifest, where)
    return Bundle(Path(path).absolute(), manifest)


def _checked(model: type[schema.Header], manifest: dict, where: Path) -> schema.Header:
    try:
        return model.model_validate(manifest)
    except pydantic.ValidationError as error:
        raise BadInputError(f"{where}: {schema.first_problem(error)}; re-run deploykit convert") from None


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
