"""Whether native code a bundle carries may run here: the one decision every loader asks.

A bundle's sha256 values live in its own manifest, so they prove a file is unchanged since the
manifest was written, not who made it. Native code (the ONNX Runtime op library, a TensorRT
engine with embedded plugins, an AOTInductor package) runs only when it is byte-identical to
what this machine's deploykit built or wrote into a bundle, or when the user consents (``trust_native=True``,
``--trust-bundle``). A foreign op library is replaced by this machine's build where deploykit
can build one; a build that has to start (CMake, minutes, on a cold cache) is announced on the
``deploykit.bundle.trust`` logger first, which Python prints on stderr unless logging is set up.
The C++ runtime (``deploykit-run``) applies the same rule to the same record
(csrc/runtime/src/trust.cpp) and names it in the same words (WRITTEN_HERE, SAME_AS_BUILD).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from deploykit.bundle.format import cached_sha256, sha256_of
from deploykit.bundle.read import Bundle
from deploykit.errors import BadInputError, EnvironmentProblem
from deploykit.native import build as native

#: sha256 of native files this machine's deploykit wrote into bundles, one a line, in the cache.
WRITTEN_RECORD = "native-written.txt"
WRITTEN_HERE = "written by this machine's deploykit"
SAME_AS_BUILD = "same as this machine's build"
FOREIGN = "foreign"
OP_LIBRARY, ENGINE, AOTI_PACKAGE = "onnxruntime-op-library", "tensorrt-engine-with-plugins", "aoti-package"

_log = logging.getLogger(__name__)


class UntrustedNativeCode(BadInputError):
    """A bundle's native file deploykit did not make here, loaded without consent (exit 2, as --trust-pickle)."""


@dataclasses.dataclass(frozen=True)
class NativeFile:
    """One native file of a bundle and where it came from, as far as this machine can tell."""

    file: str
    kind: str
    provenance: str

    @property
    def known(self) -> bool:
        return self.provenance != FOREIGN


def record_written(digests: list[str]) -> None:
    """Remember the sha256 of native files convert put into a bundle, so they load here without consent."""
    record = native.cache_dir() / WRITTEN_RECORD
    record.parent.mkdir(parents=True, exist_ok=True)
    with record.open("a") as handle:  # one short line per file: appends do not interleave
        handle.writelines(f"{digest}\n" for digest in digests)


def _written_digests() -> set[str]:
    record = native.cache_dir() / WRITTEN_RECORD
    return set(record.read_text().split()) if record.is_file() else set()


def _build_digests() -> set[str]:
    """sha256 of every library in this machine's build cache (builds listed by their manifests),
    each hashed once per process while it stays the same file."""
    digests = set()
    for manifest in (native.cache_dir() / "build").glob(f"*/{native.MANIFEST}"):
        try:
            libraries = json.loads(manifest.read_text()).get("libraries", {})
        except (OSError, ValueError):
            continue
        digests |= {cached_sha256(path) for rel in libraries.values() if (path := manifest.parent / rel).is_file()}
    return digests


def provenance(digest: str) -> str:
    if digest in _written_digests():
        return WRITTEN_HERE
    return SAME_AS_BUILD if digest in _build_digests() else FOREIGN


def native_files(bundle: Bundle) -> list[NativeFile]:
    """The bundle's op library, engines with embedded plugins and AOTInductor packages, each with its provenance here.

    Provenance is judged on the manifest's sha256, so a file changed since is caught by
    ``Bundle.file`` when it is loaded (and by inspect's file check), not here.
    """
    listed = [(bundle.op_library["file"], OP_LIBRARY)] if bundle.op_library else []
    listed += [(entry["file"], ENGINE) for entry in bundle.engines if has_plugins(entry)]
    listed += [(entry["file"], AOTI_PACKAGE) for entry in bundle.aoti]
    files = bundle.manifest.get("files", {})
    return [NativeFile(name, kind, provenance(files.get(name, {}).get("sha256", ""))) for name, kind in listed]


def has_plugins(engine: dict) -> bool:
    """Whether an engine entry embeds our plugin library (host code that runs when it is deserialized)."""
    return bool(engine.get("plugin_library_sha256") or engine.get("plugin_layers"))


def refusal(name: str, bundle: Bundle, fallback: str) -> UntrustedNativeCode:
    return UntrustedNativeCode(
        f"{bundle.path / name} is native code this machine's deploykit did not build (its sha256 in manifest.json "
        f"only proves it is unchanged since the manifest was written, not who made it): pass trust_native=True "
        f"(--trust-bundle) if you trust whoever made {bundle.path.name}{fallback}")


def op_library(bundle: Bundle, verify: bool = True, trust_native: bool = False,
               notes: list[str] | None = None) -> Path:
    """The op library to register for ``bundle``: its own copy when known here or trusted, else
    this machine's build (with a note in ``notes``); UntrustedNativeCode when neither."""
    name = bundle.op_library["file"]
    path, foreign = _native_file(bundle, name, verify)
    if trust_native or not foreign:
        return path
    try:
        local = native.find_ort_library(before_building=lambda build_dir: _announce_build(name, build_dir))
    except EnvironmentProblem:
        raise refusal(name, bundle, ", or op_library=False (--no-op-library) to run the ONNX function "
                                    "fallbacks instead") from None
    if notes is not None:
        notes.append(f"{name} in the bundle was not built here: using this machine's build {local} instead")
    return local


def _announce_build(name: str, build_dir: Path) -> None:
    """Say why deploykit.load is about to take minutes, and how to skip it, before the build starts."""
    _log.warning("building deploykit's op library from its sources (CMake, minutes; once, cached in %s): the "
                 "bundle's %s was not built here, so it is not trusted; --trust-bundle (trust_native=True) loads "
                 "it instead, --no-op-library (op_library=False) runs the ONNX function fallbacks", build_dir, name)


def _native_file(bundle: Bundle, name: str, verify: bool) -> tuple[Path, bool]:
    """The path of a native file of ``bundle`` (listed and, with ``verify``, unchanged: checked before
    anything looks inside) and whether it is foreign here."""
    path = bundle.file(name, verify)
    digest = bundle.manifest["files"][name]["sha256"] if verify else sha256_of(path)  # verified: the same bytes
    return path, provenance(digest) == FOREIGN


def is_foreign(bundle: Bundle, name: str) -> bool:
    """Whether the bundle's file ``name`` is foreign here, judged on its manifest sha256."""
    return provenance(bundle.manifest["files"][name]["sha256"]) == FOREIGN


def engine_needs_consent(bundle: Bundle, entry: dict, trust_native: bool = False) -> bool:
    """Whether the engine embeds plugins this machine's deploykit did not make, without consent given."""
    return has_plugins(entry) and not trust_native and is_foreign(bundle, entry["file"])


def plugins_problem(bundle: Bundle, entry: dict, trust_native: bool, consent: str = "--trust-bundle") -> str | None:
    """Why the engine's plugins may not run without consent (None: they may), for a backend choice
    that passes over it; ``consent`` names how to give it."""
    if engine_needs_consent(bundle, entry, trust_native):
        return f"its plugins are native code this machine's deploykit did not build ({consent} runs them)"
    return None


def engine_host_code_allowed(bundle: Bundle, entry: dict, trust_native: bool = False) -> bool:
    """Whether deserializing the engine may run host code: only an engine with plugins needs it, and
    then only when it is known here or trusted; UntrustedNativeCode otherwise."""
    if not engine_needs_consent(bundle, entry, trust_native):
        return has_plugins(entry)
    raise refusal(entry["file"], bundle, ", or run it on ONNX Runtime (backend='onnxruntime', --backend onnxruntime)")


def aoti_package(bundle: Bundle, entry: dict, verify: bool = True, trust_native: bool = False) -> Path:
    """The path of an AOTInductor package (``entry`` of ``bundle.aoti``) that may be loaded: its .so runs
    in this process, so a package this machine's deploykit did not write needs consent (UntrustedNativeCode)."""
    path, foreign = _native_file(bundle, entry["file"], verify)
    if not trust_native and foreign:
        raise refusal(entry["file"], bundle, ", or run the bundle's ONNX graph instead (backend='onnxruntime')")
    return path


def manifest_entry(name: str, kind: str, digest: str, built_from: Path | None, deploykit_version: str) -> dict:
    """One entry of the manifest's ``native`` list: which file, what it is, and the build it came from."""
    return {"file": name, "kind": kind, "sha256": digest, "deploykit": deploykit_version,
            "build": _build_key_of(built_from) if built_from else None}


def _build_key_of(path: Path) -> str | None:
    """The key (a hash of the sources, headers and toolchain) of the cached build a library came from."""
    return next((parent.name for parent in Path(path).parents if (parent / native.MANIFEST).is_file()), None)
