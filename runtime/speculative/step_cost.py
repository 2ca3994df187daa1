"""What a whole step costs: executors pad every query of a graph call to the call's widest.

Both executors run a step's sequences in right-padded graph calls grouped by query length
(`executor.padding_groups`): a sequence verifying 8 drafts among fifteen 1-token decodes
either widens a call of several rows to 9 tokens each, or costs a call of its own (every
call reads all weights): one row of 5 tokens among three of 1 costs what four rows of 5
cost. So a sequence's drafts cannot be priced alone at batch > 1: the policy prices the
step (`SpeculationPolicy.cap`), with this model.

A call of R rows padded to W tokens costs `plain(R) * ratio(R, W)`: the plain (1-token)
step of R rows and the W-token step over it, both interpolated from the compiler's
measured table (uniform batches of 1..16 rows, 1..γ+1 tokens, `measured.verify_step_ms`,
each batch size's row smoothed: `smooth_ratios`);
without one, `verify_cost` (batch 1) is the ratio at every R and each call costs a plain
step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from llmopt.runtime.executors.gathered import padding_groups


class StepCostModel:
    def __init__(self, batch_sizes: Sequence[int], plain: Sequence[float],
                 widths: Sequence[int], ratios: Sequence[Sequence[float]]):
        """`plain[i]`: a 1-token step of `batch_sizes[i]` rows (any unit); `ratios[i][j]`:
        a `widths[j]`-token step of as many rows over it (`widths[0]` == 1)."""
        if not batch_sizes or len(plain) != len(batch_sizes) or len(ratios) != len(batch_sizes):
            raise ValueError("a step cost model needs one plain cost and one ratio row per "
                             "batch size")
        if any(len(row) != len(widths) for row in ratios) or widths[0] != 1:
            raise ValueError("each ratio row needs one entry per width, starting at width 1")
        self.batch_sizes = np.asarray(batch_sizes, dtype=np.float64)
        self.plain = np.asarray(plain, dtype=np.float64)
        self.widths = np.asarray(widths, dtype=np.float64)
        # A wider step never costs less than a narrower one (the table is noisy).
        self.ratios = np.maximum.accumulate(np.asarray(ratios, dtype=np.float64), axis=1)
        self._calls: dict[tuple[int, int], float] = {}  # call_cost's answers: every step asks

    @classmethod
    def from_verify_cost(cls, verify_cost: Sequence[float]) -> StepCostModel:
        """The batch-1 table `verify_cost[k]` ((k+1)-token step over a plain one)."""
        return cls([1], [1.0], list(range(1, len(verify_cost) + 1)), [list(verify_cost)])

    @classmethod
    def from_measured(cls, measured: Mapping[str, Any],
                      verify_cost: Sequence[float]) -> StepCostModel:
        """The compiler's table when it has one (`batch_sizes`, `verify_step_ms`), else
        `verify_cost`."""
        sizes, table = measured.get("batch_sizes"), measured.get("verify_step_ms")
        if not sizes or not table or "1" not in table:
            return cls.from_verify_cost(verify_cost)
        widths = sorted(int(q) for q in table)
        plain = [float(ms) for ms in table["1"]]
        ratios = [smooth_ratios(widths, [float(table[str(q)][i]) / plain[i] for q in widths])
                  for i in range(len(sizes))]
        return cls(sizes, plain, widths, ratios)

    def call_cost(self, rows: int, width: int) -> float:
        """One graph call of `rows` rows padded to `width` tokens."""
        cost = self._calls.get((rows, width))
        if cost is None:
            plain = float(np.interp(rows, self.batch_sizes, self.plain))
            by_size = [self._ratio(row, width) for row in self.ratios]
            cost = self._calls[rows, width] = plain * float(
                np.interp(rows, self.batch_sizes, by_size))
        return cost

    def _ratio(self, row: np.ndarray, width: int) -> float:
        """A row of ratios at `width`, extended linearly past its widest entry."""
        if width <= self.widths[-1] or len(self.widths) < 2:
            return float(np.interp(width, self.widths, row))
        slope = (row[-1] - row[-2]) / (self.widths[-1] - self.widths[-2])
        return float(row[-1] + slope * (width - self.widths[-1]))

    def step_cost(self, query_lens: Sequence[int]) -> float:
        """A step whose sequences have these query lengths, grouped as the executors do."""
        lens = list(query_lens)
        return sum(self.call_cost(len(group), max(lens[i] for i in group))
                   for group in padding_groups(lens))

    def relative(self, query_lens: Sequence[int], base_lens: Sequence[int]) -> float:
        """The step over the same step with `base_lens` (its drafts left out)."""
        return self.step_cost(query_lens) / self.step_cost(base_lens)


def smooth_ratios(widths: Sequence[int], ratios: Sequence[float]) -> list[float]:
    """A measured row of W-token / 1-token step ratios, least-squares fitted to
    1 + a + b·(W - 1) for W > 1 (a, b >= 0: the first extra token may cost more than the
    next ones). The compiler times each entry a few times on whatever machine load there
    is; one entry timed in a quiet moment (a 2-token step at batch 4 "as cheap as a
    1-token one") would otherwise make drafts look free."""
    points = [(w - 1.0, r - 1.0) for w, r in zip(widths, ratios, strict=True) if w > 1]
    if not points:
        return list(ratios)
    x, y = (np.asarray(v) for v in zip(*points, strict=True))
    a, b = (np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)[0]
            if len(points) > 1 else (float(y[0]), 0.0))
    if b < 0:
        a, b = max(float(y.mean()), 0.0), 0.0
    elif a < 0:
        a, b = 0.0, max(float((x @ y) / (x @ x)), 0.0)
    return [1.0 if w == 1 else 1.0 + a + b * (w - 1) for w in widths]
