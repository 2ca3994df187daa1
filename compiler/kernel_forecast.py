"""Which kernels a freshly written artifact gets on this machine, and the recipe change
that would put it on the native step when it does not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmopt.compiler.recipe import Recipe
from llmopt.runtime.manifest import MANIFEST_FILE, Manifest
from llmopt.runtime.native import unavailable_reason
from llmopt.runtime.native.library import machine_reason

WEIGHT_PASSES = ("rtn", "gptq", "awq", "gguf_weights")


def kernel_forecast(recipe: Recipe, artifact: Path) -> list[str]:
    """Log lines: the kernels `llmopt generate/serve/bench` will pick here, and why."""
    manifest = Manifest.model_validate(json.loads((artifact / MANIFEST_FILE).read_text()))
    reason = unavailable_reason(manifest.graphs["target"], manifest.kv_cache)
    if reason is None:
        return ["kernels on this machine: native (llmopt's decoder step)"]
    lines = ["kernels on this machine: onnxruntime, not the native step: " + reason]
    fix = recipe_fix(recipe) if machine_reason() is None else None
    if fix is not None:
        lines.append(f"to run on the native step: {fix}")
    return lines


def recipe_fix(recipe: Recipe) -> str | None:
    """The first recipe change the native step needs, or None where none is known."""
    weight_passes = [step for step in recipe.passes if step.name in WEIGHT_PASSES]
    if not weight_passes:
        return ("quantize the weights: add `- rtn: {bits: 4, symmetric: true}` (its default "
                "8-bit LM head and int8 activations are the native step's; "
                "`- gguf_weights: {include_lm_head: true}` for a GGUF source)")
    step = weight_passes[-1]
    if not _includes_head(step.config):
        if step.name == "gguf_weights":
            return "the LM head is float: add `include_lm_head: true` to the gguf_weights pass"
        return (f"the LM head is float: drop `include_lm_head: false` from the {step.name} "
                "pass (its default quantizes the head at 8 bits)")
    if recipe.target.nbits_accuracy_level != 4:
        return ("set `target.nbits_accuracy_level: 4` (the native step multiplies int8 "
                "activations)")
    if recipe.target.kv_layout == "blocks":
        return "set `target.kv_layout: lanes` (the native step reads KV lanes)"
    return None


def _includes_head(config: Any) -> bool:
    return getattr(config, "include_lm_head", False) is not False  # None: the default, included
