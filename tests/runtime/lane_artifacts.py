"""What the KV eviction tests share: tiny llama lanes artifacts, and whether this CPU runs
the native step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe

# The instructions the native kernels need (runtime/native/cpu.c). Only a CPU without them
# skips: where they exist, an install without the kernels fails these tests.
NATIVE_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma"}


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    return next((set(line.split(":", 1)[1].split()) for line in lines
                 if line.startswith("flags")), set())


needs_native = pytest.mark.skipif(not cpu_flags() >= NATIVE_CPU_FLAGS,
                                  reason="this CPU lacks AVX-512 VNNI, which the native step "
                                         "needs")
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
