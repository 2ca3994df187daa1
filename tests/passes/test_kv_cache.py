"""The kv_cache pass: what it sets in the IR, key smoothing's exactness, and bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmopt.compiler.calibration import calibration_windows
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.recipe import Recipe, RecipeError, load_recipe
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes import kv_cache
from llmopt.passes.registry import PassContext

IDS = torch.tensor([[5, 17, 99, 3, 42, 8, 61, 200, 7, 13, 150, 77]])


@pytest.fixture(scope="module")
def load(tiny_checkpoints):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = load_checkpoint(str(tiny_checkpoints[arch]))
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def context(tiny_checkpoints, word_text) -> PassContext:
    recipe = Recipe(model=str(tiny_checkpoints["llama"]),
                    calibration={"text": str(word_text), "samples": 2, "seq_len": 64})
    return PassContext(recipe=recipe, log=lambda _: None)


def test_sets_each_layer_except_skipped(load):
    ir = load("llama")
    out = kv_cache.run(ir, kv_cache.Config(dtype="int8", skip_layers=[0]), None)
    assert [s.kv_dtype for s in out.ir.arch.layers] == ["float32"] + ["int8"] * (
        ir.arch.num_layers - 1)
    assert ir.arch.layers[1].kv_dtype == "float32"  # the input IR is left intact
    width = ir.arch.layers[0].num_kv_heads * ir.arch.layers[0].head_dim
    per_layer = 2 * (width + 2 * ir.arch.layers[0].num_kv_heads)  # int8 codes + f16 scales
    assert out.report["bytes_per_token"] == {
        "before": 8 * width * ir.arch.num_layers,
        "after": 8 * width + per_layer * (ir.arch.num_layers - 1)}


def with_float_kv(ir):
    """The same rewritten weights with every layer's KV kept in float32: what the pass's
    exact folds compute before any quantization."""
    arch = ir.arch
    for i in range(arch.num_layers):
        arch = arch.replace_layer(i, kv_dtype="float32")
    return dataclasses.replace(ir, arch=arch)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, q/k bias, qk-norm
def test_key_smoothing_is_exact_before_quantization(load, context, arch):
    ir = load(arch)
    out = kv_cache.run(ir, kv_cache.Config(dtype="int4", smooth_keys=0.5), context).ir
    changed = "q_norm" if ir.arch.qk_norm else "q_proj.weight"
    assert not torch.equal(out.weights[f"layers.0.{changed}"], ir.weights[f"layers.0.{changed}"])
    torch.testing.assert_close(ReferenceModel(with_float_kv(out)).forward(IDS),
                               ReferenceModel(ir).forward(IDS), rtol=0, atol=1e-4)


def test_static_channel_scales_cover_calibration(load, context):
    ir = load("llama")
    out = kv_cache.run(ir, kv_cache.Config(dtype="fp8_e4m3", key_scales="channel"), context).ir
    assert "layers.0.key_cache_scale" in out.weights
    assert "layers.0.value_cache_scale" not in out.weights  # values stay dynamic
    assert out.arch.layers[0].kv_key_scales == "channel"
    assert (out.weights["layers.0.key_cache_scale"] > 0).all()


@pytest.mark.parametrize(("options", "message"), [
    ({"dtype": "int8", "group_size": 5}, "kv_cache.group_size: 5 does not divide head_dim"),
    ({"dtype": "int4", "value_group_size": 3}, "kv_cache.value_group_size: 3"),
    ({"dtype": "int8", "skip_layers": [99]}, "kv_cache.skip_layers: layer 99 does not exist"),
])
def test_bad_options_name_the_key(load, options, message):
    with pytest.raises(ValueError, match=message):
        kv_cache.run(load("llama"), kv_cache.Config(**options), None)


def test_static_scales_need_calibration(load):
    with pytest.raises(ValueError, match="kv_cache: static scales and smooth_keys need"):
        kv_cache.run(load("llama"), kv_cache.Config(dtype="int8", key_scales="channel"), None)


@pytest.mark.parametrize(("entry", "key"), [
    ("{dtype: int3}", "passes.0.kv_cache.dtype"),
    ("{dtype: int8, key_scale: channel}", "passes.0.kv_cache.key_scale"),
])
def test_recipe_errors_name_the_key(tmp_path, entry, key):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: some/model\npasses:\n  - kv_cache: {entry}\n")
    with pytest.raises(RecipeError, match=key):
        load_recipe(recipe)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])  # plain, v bias, qk-norm
def test_rotation_is_exact_before_quantization(load, arch):
    ir = load(arch)
    out = kv_cache.run(ir, kv_cache.Config(dtype="int4", rotate=True), None).ir
    assert out.arch.layers[0].kv_rotate_keys
    torch.testing.assert_close(ReferenceModel(with_float_kv(out)).forward(IDS),
                               ReferenceModel(ir).forward(IDS), rtol=0, atol=1e-4)
    quantized = ReferenceModel(out).forward(IDS)
    assert not torch.allclose(quantized, ReferenceModel(ir).forward(IDS), atol=1e-3)


def test_static_scales_with_rotation_are_those_of_the_rotated_cache(load, context):
    """With `rotate`, static scales are calibrated on what the cache stores (rotated keys,
    values through the rotated v_proj): no calibration token clips at the top code."""
    ir = load("llama")
    config = kv_cache.Config(dtype="int8", key_scales="channel", value_scales="channel",
                             rotate=True, calibration_samples=2)
    out = kv_cache.run(ir, config, context).ir
    model, seen = ReferenceModel(with_float_kv(out)), {}
    model.kv_observer = lambda i, q, k, v: seen.setdefault(i, (k, v))
    window = calibration_windows(out, context.recipe.calibration)[:1]
    model.forward(window)
    for side, x in zip(("key", "value"), seen[0], strict=True):
        amax = x.abs().flatten(0, 1).amax(0).flatten()
        scale = out.weights[f"layers.0.{side}_cache_scale"]
        assert (amax <= 127 * scale * (1 + 1e-5)).all()
        assert (amax >= 0.5 * 127 * scale).any()  # tight, not a loose bound
