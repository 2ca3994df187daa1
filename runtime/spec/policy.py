"""How many draft tokens a sequence gets this step: only as many as pay for themselves.

A speculative step with k drafts costs `verify_cost[k] + k * draft_cost` target steps (a
(k+1)-token verification plus k draft steps) and emits, when each draft is accepted with
probability α, (1 - α^(k+1)) / (1 - α) tokens in expectation (`cost_model`). The policy
picks the k in 0..γ with the most tokens per unit of cost; k = 0 is a plain step (1
token, cost 1). The costs come from the compiler's measurements (the manifest); α is
estimated per sequence and per draft source from its own recent verifications, starting
from the compile-time acceptance. Sources differ a lot: a 4-token n-gram match is
accepted far more often than a 1-token one (`Proposal.source`), so each is priced on its
own record.

The estimate forgets at rate `decay` per decode step, speculating or not, so a sequence
whose drafts stopped paying drifts back towards the prior and is probed again later
rather than switched off for good. The costs can be re-priced per step (`set_prices`)
from what the engine measures on the machine it runs on (`governor`).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmopt.runtime.request import Request
from llmopt.runtime.spec.cost_model import expected_tokens, step_cost

POOLED = "*"  # the record of every source of a sequence together


class SpeculationPolicy:
    def __init__(
        self,
        gamma: int,
        verify_cost: Sequence[float],
        draft_cost: float,
        prior_alpha: float,
        *,
        decay: float = 0.97,
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
        self.cost_scale = 1.0  # multiplies verification's extra cost, verify_cost[k] - 1
        self.prior_alpha = prior_alpha
        self.decay = decay
        self.prior_weight = prior_weight

    def alpha(self, request: Request, source: str | None = None) -> float:
        """The acceptance estimate of `source`'s drafts for this sequence; None: the best
        over its sources (what the scheduler reserves slots for before drafting).

        Hierarchical: the sequence's pooled record (all sources) starts from the
        compile-time prior, and each source's record starts from the pooled estimate, so
        a source seen for the first time inherits what the sequence has shown so far."""
        estimates = request.spec.accept_estimate
        pooled = self._estimate(estimates.get(POOLED, (0.0, 0.0)), self.prior_alpha)
        if source is None:
            return max([pooled, *(self._estimate(estimates[s], pooled)
                                  for s in estimates if s != POOLED)])
        return self._estimate(estimates.get(source, (0.0, 0.0)), pooled)

    def _estimate(self, record: tuple[float, float], prior: float) -> float:
        accepted, rejected = record
        return (accepted + self.prior_weight * prior) / (accepted + rejected + self.prior_weight)

    def set_prices(self, cost_scale: float, draft_cost: float) -> None:
        self.cost_scale, self.draft_cost = cost_scale, draft_cost

    def cost(self, num_drafts: int) -> float:
        """A step with `num_drafts` drafts, in plain target steps."""
        return step_cost(num_drafts, self.verify_cost, self.draft_cost, self.cost_scale)

    def num_drafts(self, request: Request, source: str | None = None) -> int:
        alpha = self.alpha(request, source)
        gains = [expected_tokens(alpha, k) / self.cost(k) for k in range(self.gamma + 1)]
        return max(range(self.gamma + 1), key=gains.__getitem__)

    def observe(self, request: Request, source: str, num_drafts: int,
                num_accepted: int) -> None:
        """Record one decode step: the drafts' source, how many were verified and how many
        accepted (0, 0 for a plain step). A run of acceptances ended by a rejection is
        geometric evidence. Every source's evidence fades at each step."""
        estimates = request.spec.accept_estimate
        for name, (accepted, rejected) in estimates.items():
            estimates[name] = (self.decay * accepted, self.decay * rejected)
        if num_drafts:
            rejection = 1.0 if num_accepted < num_drafts else 0.0
            for name in {source, POOLED}:
                accepted, rejected = estimates.get(name, (0.0, 0.0))
                estimates[name] = (accepted + num_accepted, rejected + rejection)
