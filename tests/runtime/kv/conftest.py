"""What the KV tests share: comparing turned key codes with a fresh prefill's."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest


def _codes(rows: np.ndarray, kv: str) -> np.ndarray:
    """Lane key rows [..., width] as integer codes [..., head_dim] (int4: two a byte, low
    nibble first, biased by 8)."""
    if kv == "int4":
        pairs = np.stack([rows & 15, rows >> 4], axis=-1).astype(int)
        return pairs.reshape(*rows.shape[:-1], -1) - 8
    return rows.astype(int)


def assert_codes_close(got: np.ndarray, want: np.ndarray, source: np.ndarray, kv: str) -> None:
    """Turned key rows `got` within one code of `want` wherever neither `want` nor the codes
    turned (`source`) were clipped: per rotary pair (i, i + head_dim / 2) for int4, per row
    for int8 (whose artifacts here rotate keys by a Hadamard matrix, which mixes a row). The
    tiny models' scales, calibrated on a few tokens, clip often: a quarter of the codes at
    least must be checked."""
    ends = (-127, 127) if kv == "int8" else (-8, 7)
    g, w, src = (_codes(x, kv) for x in (got, want, source))
    clipped = np.isin(w, ends) | np.isin(src, ends)
    if kv == "int8":
        clipped = np.broadcast_to(clipped.any(-1, keepdims=True), clipped.shape)
    else:
        clipped = clipped | np.roll(clipped, clipped.shape[-1] // 2, axis=-1)
    assert (~clipped).mean() >= 0.25, f"only {(~clipped).mean():.0%} of the codes unclipped"
    assert np.abs(g - w)[~clipped].max() <= 1


@pytest.fixture
def codes_close() -> Callable[[np.ndarray, np.ndarray, np.ndarray, str], None]:
    """`assert_codes_close`."""
    return assert_codes_close
