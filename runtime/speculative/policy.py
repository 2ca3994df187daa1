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
rather than switched off for good.

At batch > 1 a sequence's drafts are not its own cost: the executors pad a call's rows to
its widest query, so one sequence verifying 8 drafts makes its neighbours' 1-token rows
9 tokens wide (`step_cost`). Once the drafts are known, `cap` prices the step as a whole:
the most drafts any sequence keeps, chosen for the most tokens per unit of step time.
"""

from __future__ import annotations

from collections.abc import Sequence
from weakref import WeakKeyDictionary

from llmopt.runtime.request import Request
from llmopt.runtime.speculative.cost_model import expected_tokens, step_cost
from llmopt.runtime.speculative.step_cost import StepCostModel

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
        step_model: StepCostModel | None = None,
        min_gain: float = 1.05,
        engine_decay: float = 0.98,
        engine_weight: float = 4.0,
    ):
        """verify_cost[k]: a (k+1)-token target step over a 1-token step, k = 0..γ (so
        verify_cost[0] == 1); draft_cost: a draft step over a target step; `step_model`:
        what a whole step costs (None: `verify_cost` at every batch size); `min_gain`: how
        much more tokens per unit of time than a plain step a step's drafts must promise
        (estimates are noisy: a predicted 2 % gain is a coin flip on a loaded machine)."""
        if len(verify_cost) < gamma + 1:
            raise ValueError(f"verify_cost needs {gamma + 1} entries for γ={gamma}, "
                             f"got {len(verify_cost)}")
        self.gamma = gamma
        self.verify_cost = list(verify_cost)
        self.draft_cost = draft_cost
        self.prior_alpha = prior_alpha
        self.decay = decay
        self.engine_decay, self.engine_weight = engine_decay, engine_weight
        self.prior_weight = prior_weight
        self.step_model = step_model or StepCostModel.from_verify_cost(verify_cost)
        self.min_gain = min_gain
        # Every sequence's evidence together, per source: what a sequence that has shown
        # little yet is expected to do (the compile-time α was measured on other prompts).
        self.engine_record: dict[str, tuple[float, float]] = {}
        # Each live sequence's own evidence, per source (and POOLED).
        self.records: WeakKeyDictionary[Request, dict[str, tuple[float, float]]] = (
            WeakKeyDictionary())

    def alpha(self, request: Request, source: str | None = None) -> float:
        """The acceptance estimate of `source`'s drafts for this sequence; None: the best
        over its sources (what the scheduler reserves slots for before drafting).

        Hierarchical: the engine's pooled record (every sequence, every source) starts
        from the compile-time prior; a sequence's pooled record starts from it; a
        source's record starts from the engine's record of that source, scaled by how
        much better or worse than the engine's average this sequence has done. So a
        source seen for the first time inherits what the sequence and the engine have
        shown so far."""
        estimates = self.records.get(request, {})
        engine = self._estimate(self.engine_record.get(POOLED, (0.0, 0.0)), self.prior_alpha,
                                self.engine_weight)
        pooled = self._estimate(estimates.get(POOLED, (0.0, 0.0)), engine)

        def of(name: str) -> float:
            kind = self._estimate(self.engine_record.get(name, (0.0, 0.0)), engine,
                                  self.engine_weight)
            prior = min(kind * pooled / engine, 0.99) if engine > 0 else pooled
            return self._estimate(estimates.get(name, (0.0, 0.0)), prior)

        if source is None:
            return max([pooled, *(of(s) for s in estimates if s != POOLED)])
        return of(source)

    def _estimate(self, record: tuple[float, float], prior: float,
                  weight: float | None = None) -> float:
        accepted, rejected = record
        weight = self.prior_weight if weight is None else weight
        return (accepted + weight * prior) / (accepted + rejected + weight)

    def cost(self, num_drafts: int) -> float:
        """A step with `num_drafts` drafts, in plain target steps."""
        return step_cost(num_drafts, self.verify_cost, self.draft_cost)

    def num_drafts(self, request: Request, source: str | None = None) -> int:
        alpha = self.alpha(request, source)
        gains = [expected_tokens(alpha, k) / self.cost(k) for k in range(self.gamma + 1)]
        return max(range(self.gamma + 1), key=gains.__getitem__)

    def cap(self, drafted: Sequence[tuple[Request, str, int]],
            other_lens: Sequence[int] = ()) -> int:
        """The most drafts any sequence of this step keeps: `drafted` holds each drafting
        sequence, its drafts' source and their number; `other_lens` the query lengths of
        the step's other sequences (1 for a plain decode). Each cap K gives every drafting
        sequence min(its drafts, K); the one with the most expected tokens (other
        sequences count one each) per unit of step cost wins if it beats a plain step by
        `min_gain`; else K = 0."""
        if not drafted:
            return 0
        alphas = [self.alpha(request, source) for request, source, _ in drafted]
        counts = [count for _, _, count in drafted]
        base = [1] * len(drafted) + list(other_lens)

        def gain(cap: int) -> float:
            tokens = len(other_lens) + sum(expected_tokens(alpha, min(count, cap))
                                          for alpha, count in zip(alphas, counts, strict=True))
            lens = [1 + min(count, cap) for count in counts] + list(other_lens)
            return tokens / self.step_model.relative(lens, base)

        gains = [gain(cap) for cap in range(max(counts) + 1)]
        best = max(range(len(gains)), key=gains.__getitem__)
        return best if gains[best] >= self.min_gain * gains[0] else 0

    def observe(self, request: Request, source: str, num_drafts: int,
                num_accepted: int) -> None:
        """Record one decode step: the drafts' source, how many were verified and how many
        accepted (0, 0 for a plain step). A run of acceptances ended by a rejection is
        geometric evidence. Every source's evidence fades at each step."""
        for estimates, decay in ((self.records.setdefault(request, {}), self.decay),
                                 (self.engine_record, self.engine_decay)):
            for name, (accepted, rejected) in estimates.items():
                estimates[name] = (decay * accepted, decay * rejected)
            if num_drafts:
                rejection = 1.0 if num_accepted < num_drafts else 0.0
                for name in {source, POOLED}:
                    accepted, rejected = estimates.get(name, (0.0, 0.0))
                    estimates[name] = (accepted + num_accepted, rejected + rejection)
