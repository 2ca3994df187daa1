"""What the KV eviction tests share: tiny llama lanes artifacts, and whether the native
step runs here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.runtime.native.library import kernels

HAS_NATIVE = kernels() is not None and bool(kernels().llmopt_native_supported())
needs_native = pytest.mark.skipif(not HAS_NATIVE, reason="no native kernels in this install, "
                                                         "or no AVX-512 VNNI")
BLOCK = 4
RTN = {"rtn": {"bits": 4, "group_size": 32, "symmetric": True, "include_lm_head": True,
               "lm_head_bits": 8}}
A8 = {"nbits_accuracy_level": 4}  # int8 activations: the graphs the native step runs
RUNTIME = {"block_size": BLOCK, "max_context": 64, "max_num_seqs": 2}


def kv_codes(dtype: str) -> dict[str, Any]:
    """The kv_cache pass at `dtype` with static per-channel scales (what lanes hold)."""
    return {"kv_cache": {"dtype": dtype, "key_scales": "channel", "value_scales": "channel"}}


def compile_artifacts(checkpoint: Path, word_text: Path, root: Path,
                      artifacts: dict[str, tuple[list, dict]],
                      recipe_runtime: dict[str, Any]) -> dict[str, Path]:
    """Each of `artifacts` (name -> passes, target options) compiled under `root`; those
    named "recipe..." with `recipe_runtime` added to their runtime section."""
    out = {}
    for name, (passes, target) in artifacts.items():
        runtime = {**RUNTIME, **(recipe_runtime if name.startswith("recipe") else {})}
        recipe = Recipe(model=str(checkpoint), passes=passes, target=target,
                        quality={"measure": False}, runtime=runtime,
                        calibration={"text": str(word_text), "samples": 2, "seq_len": 32,
                                     "model_samples": 0})
        out[name] = root / name
        compile_recipe(recipe, out[name], log=lambda _: None)
    return out
