"""The compile log's last word: which kernels the artifact gets here, and the fix if not native."""

from __future__ import annotations

import pytest

from llmopt.compiler.kernel_forecast import kernel_forecast, recipe_fix
from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.runtime.native.library import machine_reason

RTN = {"rtn": {"bits": 4, "symmetric": True, "include_lm_head": True, "lm_head_bits": 8}}
A8 = {"nbits_accuracy_level": 4}
NATIVE_HERE = machine_reason() is None


def recipe(passes: list, target: dict | None = None) -> Recipe:
    return Recipe(model="unused", passes=passes, target=target or {})


@pytest.mark.parametrize(("passes", "target", "fix"), [
    ([], A8, "quantize the weights: add `- rtn: {bits: 4, symmetric: true}`"),
    ([{"rtn": {"bits": 4, "include_lm_head": False}}], A8,
     "the LM head is float: drop `include_lm_head: false` from the rtn pass"),
    ([{"rtn": {"bits": 4}}], {}, None),  # the defaults: an 8-bit head, int8 activations
    ([{"gguf_weights": {}}], A8, "the LM head is float: add `include_lm_head: true` to the "
                                 "gguf_weights pass"),
    ([RTN], {}, "set `target.nbits_accuracy_level: 4`"),
    ([RTN], {**A8, "kv_layout": "blocks"}, "set `target.kv_layout: lanes`"),
    ([RTN], A8, None),
])
def test_recipe_fix_names_the_first_change_the_native_step_needs(passes, target, fix):
    found = recipe_fix(recipe(passes, target))
    assert found == fix if fix is None else found.startswith(fix)


def compiled(tiny_checkpoints, tmp_path, passes: list, target: dict) -> tuple[Recipe, list[str]]:
    full = Recipe(model=str(tiny_checkpoints["llama"]), passes=passes, target=target,
                  quality={"measure": False}, runtime={"block_size": 4, "max_context": 64})
    compile_recipe(full, tmp_path / "art", log=lambda _: None)
    return full, kernel_forecast(full, tmp_path / "art")


def test_a_float_artifact_is_told_its_kernels_and_the_fix(tiny_checkpoints, tmp_path):
    _, lines = compiled(tiny_checkpoints, tmp_path, [], {})
    assert lines[0].startswith("kernels on this machine: onnxruntime, not the native step: ")
    if NATIVE_HERE:
        assert lines[1].startswith("to run on the native step: quantize the weights")
    else:
        assert len(lines) == 1  # no recipe gives this machine the native step


@pytest.mark.skipif(not NATIVE_HERE, reason="the native step needs AVX-512 VNNI")
def test_a_native_artifact_is_told_so(tiny_checkpoints, tmp_path):
    _, lines = compiled(tiny_checkpoints, tmp_path, [RTN], A8)
    assert lines == ["kernels on this machine: native (llmopt's decoder step)"]
