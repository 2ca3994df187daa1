"""Preflight's memory estimate: a compile that cannot fit is refused before loading."""

from __future__ import annotations

import json
import time

import pytest

from llmopt.compiler.checkpoint_ref import resolve_checkpoint
from llmopt.compiler.memory_estimate import GIB, calibration_bytes, estimate_compile, read_shape
from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.preflight import InsufficientResourcesError, _advice
from llmopt.compiler.recipe import Recipe

# A 405B-class shape: no machine this test runs on holds one layer of it in float32 three times.
HUGE = dict(model_type="llama", vocab_size=128256, hidden_size=16384, intermediate_size=53248,
            num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8,
            head_dim=128, tie_word_embeddings=False)
LLAMA_8B = dict(HUGE, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32)


def _config_only(directory, fields, safetensors=True):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(fields))
    if safetensors:  # an empty shard: enough for the estimate to take the streaming path
        (directory / "model.safetensors").write_bytes(b"")
    return directory


@pytest.mark.parametrize("safetensors", [True, False])
def test_an_over_budget_compile_is_refused_before_loading(tmp_path, safetensors):
    model = _config_only(tmp_path / "huge", HUGE, safetensors)
    recipe = Recipe(model=str(model), passes=[{"rtn": {"bits": 4}}])
    started = time.perf_counter()
    with pytest.raises(InsufficientResourcesError, match=r"^compile refused before loading: "
                       r"it needs about [\d.]+ GiB of memory \(.*\) and [\d.]+ GiB is available"):
        compile_recipe(recipe, tmp_path / "out", log=lambda line: None)
    assert time.perf_counter() - started < 5
    assert not (tmp_path / "out").exists()


def test_streaming_bounds_the_weights_by_the_largest_tensor_and_one_layer(tmp_path):
    """An 8B model read a tensor at a time needs a few GiB; through transformers, ~86 GiB."""
    recipe = Recipe(model="m", passes=[{"rtn": {"bits": 4}}])
    streamed = _config_only(tmp_path / "streamed", LLAMA_8B)
    eager = _config_only(tmp_path / "eager", LLAMA_8B, safetensors=False)
    small = estimate_compile(recipe, resolve_checkpoint(str(streamed)),
                             read_shape(resolve_checkpoint(str(streamed))))
    large = estimate_compile(recipe, resolve_checkpoint(str(eager)),
                             read_shape(resolve_checkpoint(str(eager))))
    assert small.peak_bytes < 10 * GIB < 80 * GIB < large.peak_bytes
    # 6.98 G decoder parameters at 4 bits + g128 scales, float32 head and embedding: 7.6 GiB
    assert 7 * GIB < small.output_bytes < 8.5 * GIB


def test_the_head_and_the_calibration_are_not_counted_together(tmp_path):
    """A streamed GPTQ reads the 8B head and calibrates the layers at different times: its
    peak is the larger phase (measured: 7.3 GiB at 128 x 512), not their sum (15.7 GiB)."""
    ref = resolve_checkpoint(str(_config_only(tmp_path / "m", LLAMA_8B)))
    text = tmp_path / "calib.txt"
    text.write_text("text")
    recipe = Recipe(model="m", passes=[{"gptq": {"bits": 4}}],
                    calibration={"text": str(text), "samples": 128, "seq_len": 512})
    estimate = estimate_compile(recipe, ref, read_shape(ref))
    parts = estimate.parts
    assert estimate.peak_bytes == parts["process"] + max(
        parts["largest tensor"] + parts["one layer"], parts["one layer"] + parts["calibration"])
    assert 7.3 * GIB < estimate.peak_bytes < sum(parts.values()) - 5 * GIB
    assert "then the larger of weights (largest tensor" in estimate.summary()


def test_rotate_counts_the_head_it_unties(tmp_path):
    tied = _config_only(tmp_path / "tied", dict(LLAMA_8B, tie_word_embeddings=True))
    ref = resolve_checkpoint(str(tied))
    rtn = {"rtn": {"bits": 4}}
    plain, rotated = (estimate_compile(Recipe(model="m", passes=passes), ref, read_shape(ref))
                      for passes in ([rtn], [{"rotate": {}}, rtn]))
    # One more float32 [vocab, hidden] table: the head the rotation makes its own.
    assert rotated.output_bytes - plain.output_bytes == 4 * 128256 * 4096


def test_a_pre_quantized_checkpoint_streams_too(tmp_path):
    """A GPTQ 8B directory is read a module at a time, as an unquantized one is, and its
    codes are lowered as they are: an int4-sized artifact without a weight pass."""
    recipe = Recipe(model="m", passes=[])
    plain = _config_only(tmp_path / "plain", LLAMA_8B)
    gptq = _config_only(tmp_path / "gptq", dict(LLAMA_8B, quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 128}))
    plain_estimate, gptq_estimate = (
        estimate_compile(recipe, resolve_checkpoint(str(d)), read_shape(resolve_checkpoint(str(d))))
        for d in (plain, gptq))
    assert gptq_estimate.peak_bytes == plain_estimate.peak_bytes < 10 * GIB
    assert gptq_estimate.output_bytes < 0.5 * plain_estimate.output_bytes


def test_calibration_is_counted_and_named_in_the_advice(tmp_path):
    shape = read_shape(resolve_checkpoint(str(_config_only(tmp_path / "m", LLAMA_8B))))
    text = tmp_path / "calib.txt"
    text.write_text("text")
    base = Recipe(model="m", passes=[{"gptq": {"bits": 4}}],
                  calibration={"text": str(text), "samples": 8, "seq_len": 128})
    more = base.model_copy(update={"calibration": base.calibration.model_copy(
        update={"samples": 4096, "seq_len": 4096})})
    ref = resolve_checkpoint(str(tmp_path / "m"))
    small, large = (estimate_compile(r, ref, shape) for r in (base, more))
    assert large.parts["calibration"] > 64 * small.parts["calibration"]
    # the advice names calibration only where shrinking it could make the compile fit
    assert "lower calibration.samples (now 4096)" in _advice(more, ref, large, GIB)
    too_much = small.parts["calibration"] + 1
    assert _advice(base, ref, small, too_much) == "free memory or use a machine with more"


def test_calibrating_a_model_too_large_to_sample_needs_a_text(tmp_path):
    model = _config_only(tmp_path / "m", LLAMA_8B)
    recipe = Recipe(model=str(model), passes=[{"gptq": {"bits": 4}}])
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"^calibration.text: a model of 8.0B parameters is "
                                         r"too large to sample"):
        compile_recipe(recipe, tmp_path / "out", log=lambda line: None)
    assert time.perf_counter() - started < 5 and not (tmp_path / "out").exists()


def test_calibration_grows_with_the_calibration_set(tiny_checkpoints):
    shape = read_shape(resolve_checkpoint(str(tiny_checkpoints["llama"])))
    for method in ("gptq", "awq", "kv_cache"):
        small = calibration_bytes(shape, 16, 64, method)
        large = calibration_bytes(shape, 64, 64, method)
        assert large - small >= 2 * 48 * 64 * shape.hidden * 4  # the carried states
    with pytest.raises(ValueError, match="unknown method"):
        calibration_bytes(shape, 16, 64, "rtn")
