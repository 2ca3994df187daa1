"""The kv_cache pass: what it sets in the IR, key smoothing's exactness, and bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmopt.compiler import calibration_mix, model_samples
from llmopt.compiler.calibration import calibration_windows
from llmopt.compiler.kv_layout import lane_storable
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.pass_manager import PassContext
from llmopt.compiler.recipe import Recipe, RecipeError, load_recipe
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes import kv_cache, rtn
from llmopt.passes.kv_cache import calibrate, defaults, sensitivity

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
    # text windows only (model_samples 0): what they cover is checked below
    recipe = Recipe(model=str(tiny_checkpoints["llama"]),
                    calibration={"text": str(word_text), "samples": 2, "seq_len": 64,
                                 "model_samples": 0})
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
    ({"dtype": "int4", "sink_tokens": 10**6}, "kv_cache.sink_tokens: 1000000 is beyond the "
     "context"),
])
def test_bad_options_name_the_key(load, options, message):
    with pytest.raises(ValueError, match=message):
        kv_cache.run(load("llama"), kv_cache.Config(**options), None)


def test_static_scales_need_calibration(load):
    with pytest.raises(ValueError, match="kv_cache: static scales, smooth_keys, auto_skip"):
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
    out = kv_cache.run(ir, kv_cache.Config(dtype="int4", key_scales="token", rotate=True),
                       None).ir
    assert out.arch.layers[0].kv_rotate_keys
    torch.testing.assert_close(ReferenceModel(with_float_kv(out)).forward(IDS),
                               ReferenceModel(ir).forward(IDS), rtol=0, atol=1e-4)
    quantized = ReferenceModel(out).forward(IDS)
    assert not torch.allclose(quantized, ReferenceModel(ir).forward(IDS), atol=1e-3)


def test_rotate_auto_rotates_int8_wherever_it_applies(load):
    ir = load("llama")
    int8 = kv_cache.run(ir, kv_cache.Config(dtype="int8"), None)
    assert int8.report["rotate"] and all(s.kv_rotate_keys for s in int8.ir.arch.layers)
    int4 = kv_cache.run(ir, kv_cache.Config(dtype="int4", key_scales="token"), None)
    assert not int4.report["rotate"] and not int4.ir.arch.layers[0].kv_rotate_keys
    # after a weight pass the values' rotation cannot be folded: auto stays off, while
    # asking for it is an error naming the key
    quantized = rtn.run(ir, rtn.Config(bits=4, group_size=32), None).ir
    after = kv_cache.run(quantized, kv_cache.Config(dtype="int8"), None)
    assert not after.report["rotate"]
    with pytest.raises(ValueError, match=r"^kv_cache\.rotate: layers\.0\.\w+_proj is already"):
        kv_cache.run(quantized, kv_cache.Config(dtype="int8", rotate=True), None)


def test_static_scales_with_rotation_are_those_of_the_rotated_cache(load, context):
    """With `rotate`, static scales are calibrated on what the cache stores (rotated keys,
    values through the rotated v_proj): no calibration token clips at the top code."""
    ir = load("llama")
    config = kv_cache.Config(dtype="int8", key_scales="channel", value_scales="channel",
                             rotate=True, calibration_samples=2, static_scales="absmax")
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


def test_rotated_static_scales_calibrate_on_the_input_models_samples(load, tiny_checkpoints):
    """The rotation is exact, so the calibration samples are drawn from the input model:
    the compile's other passes find them memoized instead of drawing a second set."""
    ir = load("llama")
    recipe = Recipe(model=str(tiny_checkpoints["llama"]),
                    calibration={"samples": 2, "seq_len": 16})
    config = kv_cache.Config(dtype="int8", key_scales="channel", value_scales="channel",
                             rotate=True, calibration_samples=2)
    kv_cache.run(ir, config, PassContext(recipe=recipe, log=lambda _: None))
    assert model_samples.SampleMemo.key == (model_samples.fingerprint(ir), 16,
                                            calibration_mix.SAMPLE_SEED)


def test_scale_search_clips_outliers_only_where_attention_ignores_them():
    """One channel: many small entries and one outlier. Unweighted, the search clips the
    outlier for finer steps; when attention leans on the outlier, it keeps absmax."""
    x = torch.cat([torch.linspace(-1, 1, 255), torch.tensor([8.0])])[:, None]
    amax = x.abs().amax(0)
    for outlier_weight, clipped in ((1.0, True), (1e4, False)):
        weight = torch.ones_like(x)
        weight[-1] = outlier_weight
        stats = {"amax": amax, "int4": calibrate.clip_errors(x, weight, amax, "int4")}
        scale = calibrate.static_scale(stats, "int4", "search")
        assert (scale < amax / 7).item() is clipped
        assert torch.equal(calibrate.static_scale(stats, "int4", "absmax"), amax / 7)


def test_attention_weights_follow_the_attention(load):
    """A key that no query attends to weighs nothing; the position attended weighs most."""
    spec = load("llama").arch.layers[0]
    arch = load("llama").arch
    heads, kv_heads, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q = torch.zeros(1, 3, heads, dim)
    q[..., 0] = 50.0  # every query points at channel 0
    k = torch.zeros(1, 3, kv_heads, dim)
    k[0, 1, :, 0] = 1.0  # position 1 matches, positions 0 and 2 do not
    v = torch.randn(1, 3, kv_heads, dim)
    key, value = calibrate.attention_weights(arch, spec, q, k, v)
    per_position = value.reshape(3, -1).sum(-1)
    assert per_position.argmax() == 1 and per_position[1] > 10 * per_position[2]


def test_auto_skip_keeps_the_most_sensitive_layers_in_int8(load, context):
    ir = load("llama")
    config = kv_cache.Config(dtype="int4", key_scales="channel", value_scales="channel",
                             skip_dtype="int8", auto_skip=1, calibration_samples=2)
    result = kv_cache.run(ir, config, context)
    sensitivity = result.report["sensitivity_kl"]
    worst = max(sensitivity, key=sensitivity.get)
    assert result.report["skipped"] == [worst]
    dtypes = [s.kv_dtype for s in result.ir.arch.layers]
    assert dtypes == ["int8" if i == worst else "int4" for i in range(ir.arch.num_layers)]
    for i in range(ir.arch.num_layers):  # each layer's static scales fit its own codes
        assert f"layers.{i}.key_cache_scale" in result.ir.weights


def test_max_kl_keeps_the_fewest_most_sensitive_layers_that_reach_it(load, context):
    ir = load("llama")
    config = kv_cache.Config(dtype="int4", key_scales="channel", value_scales="channel",
                             skip_dtype="int8", max_kl=1e9, calibration_samples=2)
    loose = kv_cache.run(ir, config, context).report
    assert loose["skipped"] == []  # any cost is within a huge target
    kl_none = loose["kl_by_skipped"][0]
    target = kl_none * 0.999  # just below what int4 everywhere costs
    report = kv_cache.run(ir, config.model_copy(update={"max_kl": target}), context).report
    measured, skipped = report["kl_by_skipped"], report["skipped"]
    by_layer = report["sensitivity_kl"]
    count = len(skipped)
    assert count >= 1 and measured[count] <= target
    assert measured.get(count - 1, float("inf")) > target  # one layer fewer misses it
    worst = sorted(by_layer, key=lambda i: -by_layer[i])[:count]
    assert sorted(worst) == skipped


def test_an_unreachable_max_kl_is_an_error_naming_the_key(load, context):
    config = kv_cache.Config(dtype="int4", key_scales="channel", value_scales="channel",
                             skip_dtype="int8", max_kl=1e-12, calibration_samples=2)
    with pytest.raises(ValueError, match="kv_cache.max_kl: 1e-12 not reached"):
        kv_cache.run(load("llama"), config, context)


def test_int4_alone_is_static_per_channel_with_sensitive_layers_in_int8(load, context):
    config = kv_cache.Config(dtype="int4", calibration_samples=2)
    resolved = config.resolved()
    assert (resolved.key_scales, resolved.value_scales, resolved.skip_dtype) == (
        "channel", "channel", "int8")
    assert resolved.max_kl == defaults.INT4_MAX_KL
    result = kv_cache.run(load("llama"), config, context)
    layers = result.ir.arch.layers
    assert all(s.kv_key_scales == s.kv_value_scales == "channel" for s in layers)
    assert [i for i, s in enumerate(layers) if s.kv_dtype == "int8"] == result.report["skipped"]
    measured = result.report["kl_by_skipped"]
    assert measured[len(result.report["skipped"])] <= defaults.INT4_MAX_KL or (
        len(result.report["skipped"]) == len(layers) - 1)
    assert all(lane_storable(s) for s in layers)  # what the native step reads in place


def test_the_int4_defaults_target_is_the_best_the_layers_allow(load, context, monkeypatch):
    monkeypatch.setattr(defaults, "INT4_MAX_KL", 1e-12)  # out of reach: no error
    result = kv_cache.run(load("llama"), kv_cache.Config(dtype="int4", calibration_samples=2),
                          context)
    assert len(result.report["skipped"]) == load("llama").arch.num_layers - 1


@pytest.mark.parametrize(("options", "keys", "values", "skip", "max_kl"), [
    ({"dtype": "int8"}, "token", "token", "float32", None),
    ({"dtype": "int4", "group_size": 32}, "token", "token", "float32", None),
    ({"dtype": "int4", "key_scales": "block"}, "block", "token", "float32", None),
    ({"dtype": "int4", "key_scales": "channel"}, "channel", "token", "float32", None),
    ({"dtype": "int4", "auto_skip": 3}, "channel", "channel", "int8", None),
    ({"dtype": "int4", "max_kl": 0.2}, "channel", "channel", "int8", 0.2),
])
def test_a_recipe_that_names_a_layout_keeps_it(options, keys, values, skip, max_kl):
    r = kv_cache.Config(**options).resolved()
    assert (r.key_scales, r.value_scales, r.skip_dtype, r.max_kl) == (keys, values, skip, max_kl)


def test_fewest_for_kl_bisects_the_sensitivity_order():
    kls = [0.5, 0.3, 0.2, 0.1, 0.05]
    calls = []

    def kl_with(n: int) -> float:
        calls.append(n)
        return kls[n]

    assert sensitivity.fewest_for_kl(kl_with, 4, 0.15)[0] == 3
    assert len(calls) <= 4 and len(set(calls)) == len(calls)  # each count measured once
    assert sensitivity.fewest_for_kl(lambda n: kls[n], 4, 0.6)[0] == 0


@pytest.mark.parametrize(("options", "message"), [
    ({"dtype": "int8", "skip_dtype": "int8"}, "kv_cache.skip_dtype: int8 is the pass's dtype"),
    ({"dtype": "int4", "auto_skip": 9}, "kv_cache.auto_skip: 9 would leave no layer"),
])
def test_bad_skip_options_name_the_key(load, options, message):
    with pytest.raises(ValueError, match=message):
        kv_cache.run(load("llama"), kv_cache.Config(**options), None)


@pytest.mark.parametrize(("dtype", "skipped"), [("float16", True), ("bfloat16", True),
                                                ("int8", False)])
def test_a_float_only_cache_skips_the_quality_probe_and_says_why(load, tiny_checkpoints,
                                                                  word_text, dtype, skipped):
    recipe = Recipe(model=str(tiny_checkpoints["llama"]),
                    calibration={"text": str(word_text), "samples": 2, "seq_len": 64},
                    quality={"eval_text": str(word_text), "eval_windows": 1,
                             "eval_seq_len": 32})
    context = PassContext(recipe=recipe, log=lambda _: None)
    report = kv_cache.run(load("llama"), kv_cache.Config(dtype=dtype), context).report
    if skipped:
        assert report["quality"] is None and context._probe is None  # nothing was sampled
        assert report["quality_skipped"].endswith("of each key and value) is near-exact")
    else:
        assert report["quality"]["tokens"] == 31 and "quality_skipped" not in report
