"""What a compile checks before loading anything, without torch: the dry run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmopt.compiler.checkpoint_ref import CheckpointRef, resolve_checkpoint
from llmopt.compiler.pass_registry import check_order
from llmopt.runtime.manifest import MANIFEST_FILE

if TYPE_CHECKING:
    from llmopt.compiler.recipe import Recipe


def check_output_directory(out: Path) -> None:
    """An existing `out` must be an artifact (replaced at the end), never other files."""
    if out.exists() and not (out / MANIFEST_FILE).is_file():
        raise FileExistsError(f"{out} exists and is not an llmopt artifact; not replacing it")


def check_pass_options(recipe: Recipe) -> None:
    """Each pass's options against the rest of the recipe (a Config says what it rules out
    with `check_recipe(recipe)`)."""
    for step in recipe.passes:
        check = getattr(step.config, "check_recipe", None)
        if check is not None:
            check(recipe)


def check_recipe(recipe: Recipe, out: Path) -> CheckpointRef:
    """The passes' order constraints, their options against the recipe, where the artifact
    goes, and where the checkpoint is. (Calibration needs no text: calibration_mix.)"""
    check_order([step.name for step in recipe.passes])
    check_pass_options(recipe)
    check_output_directory(out)
    return resolve_checkpoint(recipe.model)
