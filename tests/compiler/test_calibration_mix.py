"""Calibration windows without the user's text: the model's own samples, mixed with a text."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from llmopt.compiler import calibration_mix, model_samples
from llmopt.compiler.calibration_mix import calibration_windows, interleave, model_share
from llmopt.compiler.loader import load_checkpoint
from llmopt.compiler.recipe import CalibrationConfig
from llmopt.compiler.sample_budget import check_calibration_source
from llmopt.runtime.texts import windows_of


@pytest.fixture(scope="module")
def ir(tiny_checkpoints):
    return load_checkpoint(str(tiny_checkpoints["llama"]))


SMALL, LARGE = 135_000_000, 8_000_000_000  # parameters either side of the sampling budget


def test_a_model_too_large_to_sample_calibrates_on_its_text_alone(ir, word_text, monkeypatch):
    config = CalibrationConfig(text=str(word_text), samples=3, seq_len=16)
    assert model_share(config, LARGE) == 0.0
    monkeypatch.setattr(calibration_mix, "can_sample", lambda count: False)
    assert calibration_windows(ir, config).tolist() == windows_of(
        ir.text_token_ids(word_text), 16, 3)


def test_a_model_too_large_to_sample_needs_a_text_or_no_samples(word_text):
    with pytest.raises(ValueError, match="calibration.text: a model of 8.0B parameters"):
        check_calibration_source(CalibrationConfig(samples=4, seq_len=16), LARGE)
    asked = CalibrationConfig(text=str(word_text), model_samples=0.5)
    with pytest.raises(ValueError, match="calibration.model_samples: a model of 8.0B"):
        check_calibration_source(asked, LARGE)
    check_calibration_source(asked, SMALL)


def test_without_a_text_every_window_is_sampled_from_the_model(ir):
    config = CalibrationConfig(samples=4, seq_len=16)
    assert model_share(config, SMALL) == 1.0
    windows = calibration_windows(ir, config)
    assert windows.shape == (4, 16) and windows.dtype == torch.int64
    expected = model_samples.sample(ir, 4, 16, calibration_mix.SAMPLE_SEED)
    assert torch.equal(windows, expected)


def test_a_text_is_mixed_in_and_the_two_are_spread_evenly(ir, word_text):
    config = CalibrationConfig(text=str(word_text), samples=4, seq_len=16)
    assert model_share(config, SMALL) == calibration_mix.MIXED_SHARE
    windows = calibration_windows(ir, config.model_copy(update={"model_samples": 0.5}))
    text = windows_of(ir.text_token_ids(word_text), 16, 2)
    sampled = calibration_mix.model_samples(ir, 2, 16)
    assert windows.tolist() == [sampled[0].tolist(), text[0], sampled[1].tolist(), text[1]]


def test_model_samples_zero_is_the_texts_first_windows(ir, word_text):
    config = CalibrationConfig(text=str(word_text), samples=3, seq_len=16, model_samples=0)
    assert calibration_windows(ir, config).tolist() == windows_of(
        ir.text_token_ids(word_text), 16, 3)


def test_interleave_spreads_the_smaller_set():
    a, b = torch.arange(2)[:, None], torch.arange(10, 16)[:, None]
    assert interleave(a, b).flatten().tolist() == [0, 10, 11, 12, 1, 13, 14, 15]
    assert interleave(a, b[:0]).flatten().tolist() == [0, 1]
    assert interleave(a[:0], b).flatten().tolist() == list(range(10, 16))


def test_a_text_share_needs_a_text():
    with pytest.raises(ValidationError, match="leaves windows to calibration.text"):
        CalibrationConfig(model_samples=0.25)
    assert CalibrationConfig(model_samples=1).model_samples == 1
