"""Speculate only where it measured faster: the engine times its own decode steps.

The compiler's batch-size limit comes from a few timings on the build machine, and the
per-sequence policy prices drafts with batch-1 costs. Neither sees the machine the
artifact runs on, its load, or how verification scales at the batch actually running.
The governor does: for each batch-size bucket (1, 2-3, 4-7, 8-15, ...) it keeps a
decayed average of seconds per emitted token over pure decode steps with speculation and
without, and switches speculation off in a bucket while it is the slower of the two.
Plain steps are interleaved now and then (and speculation re-tried after a pause) so
both averages stay current.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Bucket:
    spec_seconds_per_token: float | None = None
    plain_seconds_per_token: float | None = None
    steps: int = 0
    spec_samples: int = 0  # speculative steps timed since speculation last resumed
    paused_until: int = 0  # speculation off in this bucket until this step count


class SpeculationGovernor:
    def __init__(self, *, decay: float = 0.8, probe_every: int = 32, pause_steps: int = 64,
                 margin: float = 1.0, min_samples: int = 3):
        """Every `probe_every`-th step of a bucket runs plain (to time it); speculation is
        paused for `pause_steps` steps of a bucket when, over at least `min_samples`
        speculative steps, its time per token exceeds the plain one times `margin` (one
        slow step on a shared machine proves nothing)."""
        self.decay = decay
        self.min_samples = min_samples
        self.probe_every = probe_every
        self.pause_steps = pause_steps
        self.margin = margin
        self.buckets: dict[int, _Bucket] = {}

    def allows(self, batch_size: int) -> bool:
        """May the next step, with `batch_size` decoding sequences, speculate?"""
        bucket = self._bucket(batch_size)
        if bucket.steps < bucket.paused_until:
            return False
        if bucket.plain_seconds_per_token is None:
            return bucket.spec_seconds_per_token is not None  # time a plain step first
        return bucket.steps % self.probe_every != 0

    def record(self, batch_size: int, speculated: bool, seconds: float, tokens: int) -> None:
        """One pure decode step: how long it took and how many tokens it emitted."""
        if tokens <= 0:
            return
        bucket = self._bucket(batch_size)
        bucket.steps += 1
        per_token = seconds / tokens
        if speculated:
            bucket.spec_samples += 1
            bucket.spec_seconds_per_token = self._average(bucket.spec_seconds_per_token,
                                                          per_token)
        else:
            bucket.plain_seconds_per_token = self._average(bucket.plain_seconds_per_token,
                                                           per_token)
        spec, plain = bucket.spec_seconds_per_token, bucket.plain_seconds_per_token
        if (speculated and plain is not None and bucket.spec_samples >= self.min_samples
                and spec > self.margin * plain):
            bucket.paused_until = bucket.steps + self.pause_steps
            bucket.spec_seconds_per_token = None  # re-timed afresh when it resumes
            bucket.spec_samples = 0

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def _bucket(self, batch_size: int) -> _Bucket:
        return self.buckets.setdefault(max(batch_size, 1).bit_length(), _Bucket())
