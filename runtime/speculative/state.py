"""A request's speculation state: everything speculative decoding keeps per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(eq=False)
class SpeculationState:
    # This step's drafts, their source ("ngram3": a 3-token match, "model") and the
    # distributions they were drawn from (None: chosen deterministically); set before the
    # step runs, verified and cleared by it.
    token_ids: list[int] = field(default_factory=list)
    source: str = ""
    probs: np.ndarray | None = None
    # A draft tree's shape: parents[i] is draft i's parent (-1: the last known token);
    # None: the drafts are a chain.
    parents: list[int] | None = None
    # The suffix drafter's index of this sequence's own tokens (`suffix.NgramIndex`),
    # extended as tokens are accepted.
    ngram_index: Any = None
    # Leading known tokens whose draft-model KV is in the pool.
    num_draft_computed_tokens: int = 0
    # Totals for the request's metrics.
    num_steps: int = 0  # steps that verified drafts
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted
    # Per draft source, decayed counts of accepted drafts and of rejections (the
    # policy's evidence).
    accept_estimate: dict[str, tuple[float, float]] = field(default_factory=dict)

    def clear_drafts(self) -> int:
        """Drop this step's drafts; how many there were."""
        num_drafts = len(self.token_ids)
        self.token_ids, self.probs, self.parents = [], None, None
        return num_drafts
