"""Price draft tokens from the engine's own step timings.

The per-sequence policy decides how many drafts pay for themselves from two things: how
often that sequence's drafts are accepted, and what drafts cost. Acceptance belongs to
the sequence; cost belongs to the machine. The compiler measured costs on its build
machine at batch 1, but the artifact runs elsewhere, under other load, at other batch
sizes. So the governor times the engine's pure decode steps and, for each batch-size
bucket (1, 2-3, 4-7, 8-15, ...), keeps

- the plain step's time (interleaving a plain probe step now and then keeps it current),
- a *cost scale*: the measured extra time of speculative steps over a plain step,
  divided by the extra the step cost model (`step_cost`: the compiler's table, every call
  padded to its widest query) predicted for them,
- the draft's step cost, measured the same way against the plain step.

The policy multiplies verification's predicted extra cost by the scale and uses the
measured draft cost. Where verification turns out expensive (a large batch, a loaded
machine), drafts stop paying and the policy proposes none, for every sequence at once;
where it is cheap, good sequences speculate deeper. Acceptance never enters these
estimates, so one request whose drafts fail does not switch speculation off for others.

Every estimate is a ratio of decayed sums with a prior, so it drifts back to the
manifest's numbers when it stops being fed (speculation off in a bucket): a bucket
whose scale once priced drafts out is re-tried later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmopt.runtime.speculative.step_cost import StepCostModel

OUTLIER = 2.0  # one step moves the scale towards at most this factor of it


@dataclass
class _Bucket:
    plain_step_s: float | None = None  # decayed mean time of a plain pure-decode step
    measured_extra: float = 0.0  # decayed sum of (speculative step / plain step - 1)
    predicted_extra: float = 0.0  # decayed sum of what the step model predicted for those
    draft_time: float = 0.0  # decayed sum of drafting time / plain step time
    draft_steps: float = 0.0  # decayed sum of sequential draft steps behind it
    steps: int = 0


@dataclass(frozen=True)
class Prices:
    cost_scale: float  # multiplies the predicted extra cost of drafts
    draft_cost: float  # one draft step, in plain target steps


class SpeculationGovernor:
    def __init__(self, verify_cost: Sequence[float], draft_cost: float, *,
                 decay: float = 0.98, prior_weight: float = 0.25, plain_decay: float = 0.8,
                 probe_every: int = 16, step_model: StepCostModel | None = None):
        """`verify_cost[k]`: the manifest's (k+1)-token step over a 1-token step;
        `draft_cost`: its draft step over a target step; `step_model`: what a whole step
        costs (None: `verify_cost` at every batch size). `prior_weight` is how much
        predicted extra cost (in plain steps) the manifest's numbers count as."""
        self.step_model = step_model or StepCostModel.from_verify_cost(verify_cost)
        self.prior_draft_cost = draft_cost
        self.decay = decay
        self.prior_weight = prior_weight
        self.plain_decay = plain_decay
        self.probe_every = probe_every
        self.buckets: dict[int, _Bucket] = {}

    def allows(self, batch_size: int) -> bool:
        """May the next step speculate? Not before a plain step of this bucket has been
        timed, and not on every `probe_every`-th step (a plain probe)."""
        bucket = self._bucket(batch_size)
        return bucket.plain_step_s is not None and bucket.steps % self.probe_every != 0

    def prices(self, batch_size: int) -> Prices:
        bucket = self._bucket(batch_size)
        prior = self.prior_weight
        draft_cost = ((bucket.draft_time + prior * self.prior_draft_cost)
                      / (bucket.draft_steps + prior))
        return Prices(self._scale(bucket), max(draft_cost, 0.0))

    def record(self, num_drafts: Sequence[int], step_seconds: float,
               draft_seconds: float = 0.0) -> None:
        """One pure decode step of `len(num_drafts)` sequences: the drafts each verified,
        the step's time without drafting, and the drafting time."""
        if not num_drafts:
            return
        bucket = self._bucket(len(num_drafts))
        bucket.steps += 1
        for name in ("measured_extra", "predicted_extra", "draft_time", "draft_steps"):
            setattr(bucket, name, self.decay * getattr(bucket, name))
        if not any(num_drafts):
            old = bucket.plain_step_s
            bucket.plain_step_s = step_seconds if old is None else (
                self.plain_decay * old + (1 - self.plain_decay) * step_seconds)
            return
        plain = bucket.plain_step_s
        if plain is None:
            return
        predicted = self.step_model.relative([1 + k for k in num_drafts],
                                             [1] * len(num_drafts)) - 1
        bucket.measured_extra += self._measured_extra(bucket, step_seconds / plain - 1,
                                                      predicted)
        bucket.predicted_extra += predicted
        bucket.draft_time += draft_seconds / plain
        bucket.draft_steps += max(num_drafts)  # drafts are proposed one position at a time

    def _measured_extra(self, bucket: _Bucket, measured: float, predicted: float) -> float:
        """One step's evidence, within `OUTLIER`× of the bucket's current scale either way.

        On a shared machine one step can take several times its neighbours (another
        process's burst), and the plain reference can be stale by `probe_every` steps
        when the load changed since: unclipped, a few such steps set the scale for the
        next hundred (measured: 0.13 and 2.9 from the same run)."""
        scale = self._scale(bucket)
        return min(max(measured, predicted * scale / OUTLIER), predicted * scale * OUTLIER)

    def _scale(self, bucket: _Bucket) -> float:
        prior = self.prior_weight
        return max((bucket.measured_extra + prior) / (bucket.predicted_extra + prior), 0.0)

    def _bucket(self, batch_size: int) -> _Bucket:
        return self.buckets.setdefault(batch_bucket(batch_size), _Bucket())


def batch_bucket(batch_size: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ... share a record."""
    return max(batch_size, 1).bit_length()
