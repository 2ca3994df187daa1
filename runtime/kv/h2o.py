"""H2O (heavy-hitter oracle): a per-request KV budget of heavy hitters plus a recent window.

Every query's attention weights add up, per layer and KV head, into each lane row's
accumulated attention, summed over the query heads of each KV head's group: the native
step computes them as it attends (`llmopt_forward_scored`); on ONNX Runtime a graph
compiled for H2O returns them beside its fused attention (compiler/attention_sums.py).
When a step would overrun the budget, each layer and KV head evicts the rows of lowest
accumulated attention outside the first `sinks` and the last `recent` positions, `drop`
at a time (as streaming's drop: the cost of a compaction spread over many tokens), and
its kept rows move down in order, keys turned to their new cache positions
(`kv.compaction`), their sums with them. This is the H2O paper's rule (Zhang et al.,
2023: keep the largest accumulated attention and the most recent entries, per head) with
RoPE on cache positions as StreamingLLM does. Until the first eviction nothing differs
from full attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmopt.runtime.kv.compaction import Evictions, LaneMover
from llmopt.runtime.kv.paging import cdiv
from llmopt.runtime.kv.pools import LanePools, pool_array


@dataclass(frozen=True)
class H2OConfig:
    """Keep at most `budget` entries per request: the first `sinks`, the last `recent`
    (None: half the budget) and, per layer and KV head, the heavy hitters in between.

    `drop`: entries evicted at once (None: a sixteenth of the budget in whole blocks, at
    least one block). The recent window a token sees shrinks by nothing; the heavy hitters'
    share by up to `drop` - 1.
    """

    budget: int = 2048
    recent: int | None = None
    sinks: int = 0
    drop: int | None = None

    def recent_size(self) -> int:
        return self.budget // 2 if self.recent is None else self.recent

    def heavy(self) -> int:
        """Entries left to the heavy hitters."""
        return self.budget - self.sinks - self.recent_size()

    def drop_size(self, block_size: int) -> int:
        if self.drop is not None:
            return self.drop
        return max(self.budget // 16 // block_size, 1) * block_size

    def check(self, *, max_context: int, block_size: int, max_position: int) -> None:
        """One-line errors for settings a lane cannot honour (before any work)."""
        if self.sinks < 0 or self.recent_size() < 1:
            raise ValueError(f"h2o: sinks {self.sinks} must be >= 0 and the recent window "
                             f"{self.recent_size()} >= 1")
        if self.heavy() < 1:
            raise ValueError(f"h2o: the budget {self.budget} must exceed the recent window "
                             f"{self.recent_size()} plus {self.sinks} sinks")
        if self.budget > min(max_context, max_position):
            raise ValueError(f"h2o: the budget {self.budget} is larger than the context "
                             f"({min(max_context, max_position)} positions)")
        if self.drop is not None and self.drop < 1:
            raise ValueError(f"h2o: drop {self.drop} must be >= 1")
        if self.heavy() < 2 * self.drop_size(block_size):
            raise ValueError(f"h2o: the heavy hitters' share {self.heavy()} (budget - recent "
                             f"- sinks) must span at least two drops of "
                             f"{self.drop_size(block_size)}")

    def max_step_tokens(self, block_size: int) -> int:
        """Most tokens one step may compute: a drop then always finds its rows between the
        sinks and the recent window."""
        return self.heavy() - self.drop_size(block_size)


class H2OKV(Evictions):
    """The accumulated attention of every lane, which the native step adds to, and the
    evictions over every attached lane pool."""

    def __init__(self, config: H2OConfig, block_size: int, mover: LaneMover, *,
                 layers: int, lanes: int, kv_heads: int, lane_tokens: int):
        super().__init__()
        self.config = config
        self.block_size = block_size
        self.mover = mover
        # [layers, lanes, kv_heads, lane_tokens]: zero past each lane's entries
        self.sums = pool_array((layers, lanes, kv_heads, lane_tokens), np.float32)

    def to_drop(self, cached: int, num_new_tokens: int) -> int:
        """Entries to evict before a step of `num_new_tokens` over `cached`: whole drops,
        enough that the step fits the budget."""
        over = cached + num_new_tokens - self.config.budget
        if over <= 0:
            return 0
        unit = self.config.drop_size(self.block_size)
        drop = cdiv(over, unit) * unit
        if drop > cached - self.config.sinks - self.config.recent_size():
            raise ValueError(f"h2o: a step of {num_new_tokens} tokens does not fit the heavy "
                             f"hitters' share {self.config.heavy()}")
        return drop

    def drop(self, request_id: str, pools: list[LanePools], lane: int, cached: int,
             drop: int) -> None:
        """Evict `drop` of the lane's `cached` entries per layer and KV head (`kept_rows`)."""
        sums = self.sums[:, lane]
        keep = kept_rows(sums[..., :cached], self.config.sinks, self.config.recent_size(),
                         drop)
        self.mover.compact(pools, lane, keep)
        kept = keep.shape[-1]
        sums[..., :kept] = np.take_along_axis(sums[..., :cached], keep, axis=-1)
        sums[..., kept:cached] = 0
        self.add(request_id, drop)

    def forget(self, request_id: str, lane: int | None = None) -> None:
        super().forget(request_id)
        if lane is not None:  # the next request in the lane starts from no attention
            self.sums[:, lane] = 0


def kept_rows(sums: np.ndarray, sinks: int, recent: int, drop: int) -> np.ndarray:
    """Rows kept [..., cached - drop], ascending, per leading index of `sums` [..., cached]:
    all but the `drop` of lowest sum among rows sinks .. cached - recent - 1."""
    cached = sums.shape[-1]
    candidates = sums[..., sinks:cached - recent]
    evicted = np.argpartition(candidates, drop - 1, axis=-1)[..., :drop] + sinks
    shown = np.ones(sums.shape, bool)
    np.put_along_axis(shown, evicted, False, axis=-1)
    rows = np.broadcast_to(np.arange(cached), sums.shape)
    return rows[shown].reshape(*sums.shape[:-1], cached - drop)
