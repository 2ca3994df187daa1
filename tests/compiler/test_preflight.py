"""What a compile refuses before loading anything: here, calibrating passes without text."""

from __future__ import annotations

import pytest

from llmopt.compiler.preflight import check_calibration_text, check_pass_options
from llmopt.compiler.recipe import Recipe


@pytest.mark.parametrize("step", [
    {"awq": {"bits": 4}},
    {"gptq": {"bits": 4}},
    {"kv_cache": {"dtype": "int8", "key_scales": "channel"}},
    {"kv_cache": {"dtype": "int4", "smooth_keys": 0.5}},
    {"gqa_regroup": {"kv_heads": 1, "kv_cache_reduction": 0.5}},
    {"gqa_regroup": {"kv_heads": 1, "layers": [0], "method": "mean"}},  # the fit reads text
])
def test_a_calibrating_pass_without_calibration_text_is_refused(step):
    (name,) = step
    recipe = Recipe(model="m", passes=[*([{"rtn": {"bits": 8}}] if name == "kv_cache" else []),
                                       step])
    index = len(recipe.passes) - 1
    with pytest.raises(ValueError, match=rf"^passes\.{index} \({name}\) needs calibration\.text"):
        check_calibration_text(recipe)


@pytest.mark.parametrize("step", [
    {"rtn": {"bits": 4}},
    {"kv_cache": {"dtype": "int8"}},
    {"gqa_regroup": {"kv_heads": 1, "layers": [0], "method": "mean", "fit_steps": 0}},
])
def test_passes_that_need_no_text_pass(step):
    check_calibration_text(Recipe(model="m", passes=[step]))


def test_with_calibration_text_every_pass_passes(tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("text")
    check_calibration_text(Recipe(model="m", passes=[{"awq": {"bits": 4}}],
                                  calibration={"text": str(text)}))


@pytest.mark.parametrize(("options", "recipe", "message"), [
    ({"sink_tokens": 4096}, {}, r"kv_cache\.sink_tokens: 4096 is beyond the context "
     r"\(runtime\.max_context: 2048"),
    ({"sink_tokens": 32}, {}, r"kv_cache\.sink_tokens: 32 do not fit one block"),
    ({"sink_tokens": 4}, {"target": {"kv_layout": "lanes"}},
     r"kv_cache\.sink_tokens: needs target\.kv_layout blocks"),
])
def test_pass_options_are_checked_against_the_recipe(options, recipe, message):
    recipe = Recipe(model="m", passes=[{"kv_cache": {"dtype": "int4", **options}}], **recipe)
    with pytest.raises(ValueError, match=message):
        check_pass_options(recipe)
    check_pass_options(Recipe(model="m", passes=[{"kv_cache": {"dtype": "int4"}}]))
