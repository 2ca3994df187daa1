"""Moving a lane's kept entries down to new rows, their keys turned to the rows' positions
(what `kv.streaming` and `kv.h2o` do when they evict).

A key at row p was rotated by R(p) (rotate-half rotary, the graph's tables); moved to row
q < p it must hold R(q) k = R(-(p - q)) R(p) k. Each entry moves by its own distance (H2O
keeps different rows per layer and KV head). Codes of static per-channel scales (int8,
int4) are decoded with their scales, turned, and rounded back with the same scales (half
to even, clipped, as the step stores them); values move as they are. A KV rotation after
rotary (the kv_cache pass's) is undone before the turn and redone after.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmopt.runtime.kv.pools import LanePools

CODE_RANGE = {8: (-127, 127), 4: (-8, 7)}  # the step's clip of int8 and int4 codes


@dataclass(frozen=True)
class KeyFormat:
    """How one layer's lanes hold keys: `bits` 32/16 (floats) or 8/4 (codes of `scale`
    [kv_heads, 1, head_dim]); `rotation` [head_dim, head_dim]: stored keys are (R k) @ it."""

    bits: int = 32
    scale: np.ndarray | None = None
    rotation: np.ndarray | None = None


FLOAT32 = KeyFormat()


def decode_keys(rows: np.ndarray, key: KeyFormat) -> np.ndarray:
    """Lane key rows [..., stored width] as float32 [..., head_dim], rotation undone."""
    if key.bits == 4:  # element 2j in the low nibble of byte j, codes + 8
        codes = np.stack([rows & 15, rows >> 4], axis=-1).reshape(*rows.shape[:-1], -1)
        rows = codes.astype(np.int8) - np.int8(8)
    x = rows.astype(np.float32, copy=False)  # float32 rows: a gathered copy already
    if key.scale is not None:
        x = x * key.scale
    return x if key.rotation is None else x @ key.rotation.T


def encode_keys(x: np.ndarray, key: KeyFormat, dtype: np.dtype) -> np.ndarray:
    """decode_keys' inverse: float32 keys [..., head_dim] as lane rows of `dtype`."""
    if key.rotation is not None:
        x = x @ key.rotation
    if key.bits not in CODE_RANGE:
        return x.astype(dtype, copy=False)
    assert key.scale is not None
    low, high = CODE_RANGE[key.bits]
    codes = np.clip(np.rint(x / key.scale), low, high).astype(np.int8)
    if key.bits == 8:
        return codes
    biased = (codes + 8).astype(np.uint8)
    return biased[..., 0::2] | (biased[..., 1::2] << 4)


class LaneMover:
    """Compacts lanes: the rotary tables, and each layer's key format (by layer index)."""

    def __init__(self, rope_cos: np.ndarray, rope_sin: np.ndarray,
                 key_formats: dict[int, KeyFormat] | None = None):
        """`rope_cos`, `rope_sin`: [positions, head_dim / 2] as the graph rotates keys
        (rotate-half: pairs i and i + head_dim / 2); `key_formats`: float32 where absent."""
        self.rope_cos = np.asarray(rope_cos, np.float32)
        self.rope_sin = np.asarray(rope_sin, np.float32)
        self.key_formats = key_formats or {}

    def compact(self, pools: list[LanePools], lane: int, keep: np.ndarray) -> None:
        """Row keep[..., i] of the lane moves to row i (keep ascending): `keep` [n] for every
        layer and KV head, or [layers, kv_heads, n] each its own."""
        for pool_set in pools:
            for name, array in pool_set.arrays.items():
                layer = int(name.split(".")[1])  # past.{layer}.{key|value}
                rows = array[lane]  # [kv_heads, lane tokens, stored width]
                kept = keep if keep.ndim == 1 else keep[layer]
                start = first_moved(kept)
                if start is None:
                    continue
                sources = kept[..., start:]
                moved = gather_rows(rows, sources)
                if name.endswith(".key"):
                    distance = sources - np.arange(start, kept.shape[-1])
                    key = self.key_formats.get(layer, FLOAT32)
                    moved = encode_keys(self.turn_back(decode_keys(moved, key), distance),
                                        key, rows.dtype)
                rows[:, start:kept.shape[-1]] = moved

    def turn_back(self, keys: np.ndarray, distance: int | np.ndarray) -> np.ndarray:
        """Keys [..., head_dim] rotated at p, rotated at p - distance instead (a new array):
        `distance` an int, or one per key ([...] of keys' leading shape, broadcast)."""
        distance = np.asarray(distance)
        if distance.ndim and (distance == distance.flat[0]).all():  # one row of cos, sin
            distance = distance.flat[0]
        cos, sin = self.rope_cos[distance], self.rope_sin[distance]
        half = keys.shape[-1] // 2
        a, b = keys[..., :half], keys[..., half:]
        turned = np.empty(keys.shape, np.float32)
        np.multiply(a, cos, out=turned[..., :half])
        turned[..., :half] += b * sin
        np.multiply(b, cos, out=turned[..., half:])
        turned[..., half:] -= a * sin
        return turned


def gather_rows(rows: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """rows [heads, tokens, width] at `sources` [n] (every head's) or [heads, n] (each
    head's own): [heads, n, width], whole rows copied (a flat row index, not an index per
    element as take_along_axis builds)."""
    if sources.ndim == 1:
        return rows[:, sources]
    heads, tokens = rows.shape[:2]
    flat = (sources + np.arange(heads)[:, None] * tokens).reshape(-1)
    return rows.reshape(heads * tokens, -1)[flat].reshape(*sources.shape, -1)


def first_moved(keep: np.ndarray) -> int | None:
    """The first row any head's `keep` moves (None: none moves)."""
    moved = (keep != np.arange(keep.shape[-1])).reshape(-1, keep.shape[-1]).any(axis=0)
    return int(moved.argmax()) if moved.any() else None


class Evictions:
    """Per request: how many positions its lane dropped so far."""

    def __init__(self) -> None:
        self.evicted: dict[str, int] = {}  # request id -> positions dropped so far

    def num_evicted(self, request_id: str) -> int:
        return self.evicted.get(request_id, 0)

    def add(self, request_id: str, count: int) -> None:
        self.evicted[request_id] = self.num_evicted(request_id) + count

    def forget(self, request_id: str, lane: int | None = None) -> None:
        """The request left its lane (`lane`, where it had one)."""
        self.evicted.pop(request_id, None)
