"""What a compile checks before loading anything, without torch: the dry run."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from llmopt.compiler.checkpoint_ref import CheckpointRef, resolve_checkpoint
from llmopt.compiler.memory_estimate import (
    GIB,
    CompileEstimate,
    available_memory,
    calibrates,
    estimate_compile,
    read_shape,
)
from llmopt.compiler.pass_registry import check_order
from llmopt.compiler.sample_budget import check_calibration_source
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


class InsufficientResourcesError(MemoryError):
    """A compile that would not fit this machine's memory or disk, refused before loading."""


def check_resources(recipe: Recipe, ref: CheckpointRef, out: Path) -> None:
    """Refuse, in one line, a compile whose estimated peak memory or output does not fit."""
    shape = read_shape(ref)
    if shape is None:  # no config.json to read (a GGUF file): the loader will tell
        return
    if any(calibrates(step.config) for step in recipe.passes):
        check_calibration_source(recipe.calibration, shape.params)
    estimate = estimate_compile(recipe, ref, shape)
    available = available_memory()
    if estimate.peak_bytes > available:
        raise InsufficientResourcesError(
            f"compile refused before loading: it needs about {estimate.peak_bytes / GIB:.1f} "
            f"GiB of memory ({estimate.summary()} GiB) and {available / GIB:.1f} GiB is "
            f"available; {_advice(recipe, ref, estimate, estimate.peak_bytes - available)}")
    free = shutil.disk_usage(_existing_parent(out)).free
    needed = 2 * estimate.output_bytes  # the artifact and the passes' scratch beside it
    if needed > free:
        raise InsufficientResourcesError(
            f"compile refused before loading: it writes about {needed / GIB:.1f} GiB "
            f"(artifact and scratch) beside {out} and {free / GIB:.1f} GiB is free there")


def _advice(recipe: Recipe, ref: CheckpointRef, estimate: CompileEstimate,
            excess: int) -> str:
    """What to change: the part of the estimate a recipe or source can shrink by `excess`
    bytes, else freeing memory."""
    if "whole model in float32" in estimate.parts:
        return ("give a safetensors directory (read a layer at a time) instead of "
                f"{ref.gguf_file or 'this checkpoint'}")
    if _calibration_sets_the_peak(estimate) and estimate.parts["calibration"] > excess:
        return (f"lower calibration.samples (now {recipe.calibration.samples}) or "
                f"calibration.seq_len (now {recipe.calibration.seq_len})")
    return "free memory or use a machine with more"


def _calibration_sets_the_peak(estimate: CompileEstimate) -> bool:
    """Whether shrinking the calibration set lowers the peak (its phase is the largest)."""
    if "calibration" not in estimate.parts:
        return False
    sums = {phase: sum(estimate.parts[n] for n in names)
            for phase, names in estimate.phases.items()}
    return not sums or max(sums, key=sums.get) == "calibration"


def _existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


def check_recipe(recipe: Recipe, out: Path) -> CheckpointRef:
    """The passes' order constraints, their options against the recipe, where the artifact
    goes, where the checkpoint is, and whether it fits. (Calibration needs no text.)"""
    check_order([step.name for step in recipe.passes])
    check_pass_options(recipe)
    check_output_directory(out)
    ref = resolve_checkpoint(recipe.model)
    check_resources(recipe, ref, out)
    return ref
