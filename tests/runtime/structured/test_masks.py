"""Token bitmasks applied to logits: bit t of word t // 32 allows token t."""

from __future__ import annotations

import numpy as np

from llmopt.runtime.structured.masks import allow_all, allow_only, apply_masks


def test_apply_masks_keeps_exactly_the_allowed_tokens():
    rng = np.random.default_rng(0)
    vocab = 100
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    allowed = rng.random((3, vocab)) < 0.3
    bitmask = allow_all(3, vocab)
    bitmask[:] = 0
    for row, token in zip(*np.nonzero(allowed), strict=True):
        bitmask[row, token // 32] |= np.int32(1 << (token % 32)) if token % 32 < 31 \
            else np.int32(-(1 << 31))
    masked = apply_masks(logits, bitmask)
    assert masked.dtype == np.float32
    np.testing.assert_array_equal(masked[allowed], logits[allowed])
    assert np.all(np.isneginf(masked[~allowed]))
    assert not np.isneginf(logits).any()  # the input is left alone


def test_tokens_past_the_mask_are_never_allowed():
    logits = np.zeros((1, 100), dtype=np.float32)  # an LM head wider than the tokenizer
    masked = apply_masks(logits, allow_all(1, 64))  # two words, every bit set
    assert not np.isneginf(masked[0, :64]).any()
    assert np.isneginf(masked[0, 64:]).all() and masked.shape == (1, 100)


def test_allow_only_allows_exactly_one_token():
    for token in (0, 31, 32, 63, 70):
        bitmask = allow_all(2, 96)
        allow_only(bitmask, 1, token)
        masked = apply_masks(np.zeros((2, 96), dtype=np.float32), bitmask)
        assert np.flatnonzero(np.isfinite(masked[1])).tolist() == [token]
        assert np.isfinite(masked[0]).all()
