"""What speculation did for a request, and the sum over requests (benchmarks, servers)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculationMetrics:
    num_decode_steps: int  # target steps that gave the request tokens
    num_spec_steps: int  # of those, steps that verified drafts
    num_draft_tokens: int  # drafts verified
    num_accepted_tokens: int  # drafts accepted

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts / verified drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Accepted drafts per speculative step (the step also emits one more token)."""
        return self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else None

    def tokens_per_step(self, num_output_tokens: int) -> float | None:
        """Output tokens per target step that gave tokens (1.0 without speculation)."""
        return num_output_tokens / self.num_decode_steps if self.num_decode_steps else None

    def to_dict(self, num_output_tokens: int) -> dict[str, float | int | None]:
        return {
            "decode_steps": self.num_decode_steps,
            "spec_steps": self.num_spec_steps,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": _round(self.acceptance_rate),
            "mean_accepted_length": _round(self.mean_accepted_length),
            "tokens_per_step": _round(self.tokens_per_step(num_output_tokens)),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def total_speculation(metrics: Iterable[SpeculationMetrics | None]) -> SpeculationMetrics | None:
    """The requests' speculation counters summed; None when nothing speculated."""
    metrics = [m for m in metrics if m]
    if not metrics or not any(m.num_spec_steps for m in metrics):
        return None
    return SpeculationMetrics(*(sum(values) for values in zip(
        *((m.num_decode_steps, m.num_spec_steps, m.num_draft_tokens, m.num_accepted_tokens)
          for m in metrics), strict=True)))
