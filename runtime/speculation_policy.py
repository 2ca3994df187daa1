"""How many draft tokens a sequence gets this step: only as many as pay for themselves.

A speculative step with k drafts costs `verify_cost[k] + k * draft_cost` target steps
(a (k+1)-token verification plus k draft steps) and emits, when each draft is accepted
with probability α, (1 - α^(k+1)) / (1 - α) tokens in expectation. The policy picks the
k in 0..γ with the most tokens per unit of cost; k = 0 is a plain step (1 token, cost
1). The costs come from the compiler's measurements (the manifest); α is estimated per
sequence from its own recent verifications, starting from the compile-time acceptance.

The estimate forgets at rate `decay` per decode step, speculating or not, so a sequence
whose drafts stopped paying drifts back towards the prior and is probed again later
rather than switched off for good.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmopt.runtime.request import Request


def expected_tokens(alpha: float, num_drafts: int) -> float:
    """Tokens a step emits with `num_drafts` drafts, each accepted with probability α."""
    if alpha >= 1.0:
        return num_drafts + 1.0
    return (1.0 - alpha ** (num_drafts + 1)) / (1.0 - alpha)


class SpeculationPolicy:
    def __init__(
        self,
        gamma: int,
        verify_cost: Sequence[float],
        draft_cost: float,
        prior_alpha: float,
        *,
        decay: float = 0.9,
        prior_weight: float = 1.0,
    ):
        """verify_cost[k]: a (k+1)-token target step over a 1-token step, k = 0..γ (so
        verify_cost[0] == 1); draft_cost: a draft step over a target step."""
        if len(verify_cost) < gamma + 1:
            raise ValueError(f"verify_cost needs {gamma + 1} entries for γ={gamma}, "
                             f"got {len(verify_cost)}")
        self.gamma = gamma
        self.verify_cost = list(verify_cost)
        self.draft_cost = draft_cost
        self.prior_alpha = prior_alpha
        self.decay = decay
        self.prior_weight = prior_weight

    def alpha(self, request: Request) -> float:
        accepted, rejected = request.spec_accept_estimate
        prior = self.prior_weight
        return (accepted + prior * self.prior_alpha) / (accepted + rejected + prior)

    def num_drafts(self, request: Request) -> int:
        alpha = self.alpha(request)
        gains = [expected_tokens(alpha, k) / (self.verify_cost[k] + k * self.draft_cost)
                 for k in range(self.gamma + 1)]
        return max(range(self.gamma + 1), key=gains.__getitem__)

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Record one decode step: how many drafts were verified and accepted (0, 0 for a
        plain step). A run of acceptances ended by a rejection is geometric evidence."""
        accepted, rejected = request.spec_accept_estimate
        rejection = 1.0 if num_accepted < num_drafts else 0.0
        request.spec_accept_estimate = (self.decay * accepted + num_accepted,
                                        self.decay * rejected + rejection)
