"""Loading an artifact directory: its manifest, checked for format version and file hashes
(`check`: against its own graphs, read by `onnx_signature`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import ValidationError

from llmopt.runtime.artifact.check import ManifestMismatch, check_manifest_against_graphs
from llmopt.runtime.contract import FORMAT_VERSION
from llmopt.runtime.manifest import MANIFEST_FILE, Manifest


class ArtifactError(ValueError):
    """The directory is not an artifact this runtime can load, or its files are corrupt."""


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate `path/manifest.json`, then check every file it lists."""
    path = Path(path)
    manifest_path = require_manifest_file(path)
    try:
        raw = json.loads(manifest_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"corrupt artifact {path}: {MANIFEST_FILE}: {exc}") from None
    if not isinstance(raw, dict):
        raise ArtifactError(f"corrupt artifact {path}: {MANIFEST_FILE} is not a JSON object")
    # Check the version before the schema: a newer manifest may not validate at all,
    # and the version mismatch is the error worth reporting.
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{manifest_path} has format_version {version} but this runtime reads "
            f"format_version {FORMAT_VERSION}; recompile the artifact or update llmopt"
        )
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        raise ArtifactError(f"corrupt artifact {path}: {MANIFEST_FILE}: "
                            f"{_first_error(exc)}") from None
    check_required_files_listed(path, manifest)
    verify_files(path, manifest.files)
    try:
        check_manifest_against_graphs(path, manifest)
    except ManifestMismatch as exc:
        raise ArtifactError(f"corrupt artifact {path}: {exc}") from None
    return manifest


def require_manifest_file(path: Path) -> Path:
    """The artifact's manifest path; the cheap check a command makes before anything slow."""
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise ArtifactError(f"{path} is not an llmopt artifact: {MANIFEST_FILE} is missing")
    return manifest_path


def _first_error(exc: ValidationError) -> str:
    """pydantic's first error as `field.path: message` on one line."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "(top level)"
    return f"{where}: {error['msg']}"


def required_files(manifest: Manifest) -> list[str]:
    """Every file the runtime reads: graphs, their weights, the tokenizer, and what a
    graph reads beside them (a token map)."""
    files = [manifest.tokenizer.file]
    for graph in manifest.graphs.values():
        files += [graph.file] + ([graph.data_file] if graph.data_file else [])
    for graph in manifest.runnable_graphs():
        files += graph.side_files
    return files


def check_required_files_listed(path: Path, manifest: Manifest) -> None:
    """A file the runtime reads but the manifest does not hash would go unchecked."""
    for file in required_files(manifest):
        if file not in manifest.files:
            raise ArtifactError(f"corrupt artifact {path}: {file} is not in the manifest's "
                                "files, so its sha256 cannot be checked")


def verify_files(path: Path, files: dict[str, str]) -> None:
    """Every listed file exists and has the sha256 the manifest records."""
    for relative, expected in files.items():
        file = path / relative
        if not file.is_file():
            raise ArtifactError(f"corrupt artifact {path}: {relative} is missing")
        actual = sha256_file(file)
        if actual != expected:
            raise ArtifactError(
                f"corrupt artifact {path}: sha256 of {relative} is {actual}, "
                f"the manifest records {expected}"
            )


def sha256_file(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
