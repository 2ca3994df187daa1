"""What a compile refuses before loading anything: pass options the recipe rules out."""

from __future__ import annotations

import pytest

from llmopt.compiler.preflight import check_pass_options
from llmopt.compiler.recipe import Recipe


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
