"""Streaming generation past the context (StreamingLLM): attention sinks plus a window.

A request keeps its first `sinks` positions and its last `window` positions in its lane.
When a step would overrun `sinks + window`, the oldest positions after the sinks are
dropped some blocks at a time (`StreamingConfig.drop`): the kept entries move down the
lane and their keys turn back by the distance moved (R(p - d) k = R(-d) R(p) k), so
every entry sits at its cache position and the rotary stays within the positions the
model was trained on, as the paper does. Until the first drop nothing differs from full
attention.

Supported: the lanes layout with float32 or float16 keys and values, or int8/int4 codes
of static per-channel scales (kept keys decoded, turned and rounded back with the same
scales: `kv.compaction`); the rotary tables are the graph's, which its manifest names
in the native plan or, where the native step cannot run it (float activations, float
weights), beside the reason (float32/float16 lanes then: only a plan names code scales).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmopt.runtime.kv.compaction import Evictions, LaneMover
from llmopt.runtime.kv.paging import cdiv


@dataclass(frozen=True)
class StreamingConfig:
    """Keep the first `sinks` positions and the last `window` positions of each request.

    `drop`: positions dropped at once, whole blocks (None: a sixteenth of the window in
    whole blocks, at least one). Each drop moves and turns the whole window, so larger
    drops cost less per token; the window a token sees shrinks by up to `drop` - 1.
    """

    sinks: int = 4
    window: int = 2044
    drop: int | None = None

    def drop_size(self, block_size: int) -> int:
        if self.drop is not None:
            return self.drop
        return max(self.window // 16 // block_size, 1) * block_size

    def budget(self) -> int:
        return self.sinks + self.window

    def check(self, *, max_context: int, block_size: int, max_position: int) -> None:
        """One-line errors for settings the lanes cannot honour (before any work)."""
        if self.sinks < 0 or self.window < 1:
            raise ValueError(f"streaming: sinks {self.sinks} must be >= 0 and window "
                             f"{self.window} >= 1")
        if self.sinks >= self.window:
            raise ValueError(f"streaming: sinks {self.sinks} must be below the window "
                             f"{self.window}")
        if self.budget() > min(max_context, max_position):
            raise ValueError(f"streaming: sinks + window = {self.budget()} is larger than "
                             f"the context ({min(max_context, max_position)} positions)")
        if self.drop is not None and (self.drop < 1 or self.drop % block_size):
            raise ValueError(f"streaming: drop {self.drop} must be a whole number of blocks "
                             f"of {block_size}")
        if self.window < 2 * self.drop_size(block_size):
            raise ValueError(f"streaming: the window {self.window} must span at least two "
                             f"drops of {self.drop_size(block_size)} positions (whole blocks "
                             f"of {block_size})")

    def max_step_tokens(self, block_size: int) -> int:
        """Most tokens one step may compute: what is left of the window after a drop, so
        a step never evicts entries of its own."""
        return self.window - self.drop_size(block_size)


class StreamingKV(Evictions):
    """Per request: how many positions were dropped; and the drop itself over every
    attached lane pool (move down, turn keys back: `LaneMover`)."""

    def __init__(self, config: StreamingConfig, block_size: int, mover: LaneMover):
        super().__init__()
        self.config = config
        self.block_size = block_size
        self.mover = mover

    def to_drop(self, cached: int, num_new_tokens: int) -> int:
        """Positions to drop before a step of `num_new_tokens` over `cached` entries: whole
        drops, enough that the step fits the budget."""
        over = cached + num_new_tokens - self.config.budget()
        if over <= 0:
            return 0
        unit = self.config.drop_size(self.block_size)
        drop = cdiv(over, unit) * unit
        if drop > cached - self.config.sinks:
            raise ValueError(f"streaming: a step of {num_new_tokens} tokens does not fit "
                             f"the window {self.config.window}")
        return drop

    def drop(self, request_id: str, pools: list, lane: int, cached: int, drop: int) -> None:
        """Drop positions sinks .. sinks + drop - 1 of the lane's `cached` entries."""
        sinks = self.config.sinks
        keep = np.concatenate([np.arange(sinks), np.arange(sinks + drop, cached)])
        self.mover.compact(pools, lane, keep)
        self.add(request_id, drop)
