"""Speculator: what the engine's step asks of speculative decoding, in one object.

Per step: `max_drafts` gives the scheduler each sequence's draft budget (None: no
speculation this step, above the batch-size limit); `propose` fills the draft slots the
scheduler reserved, then trims the drafts to what pays for the step as a whole
(`SpeculationPolicy.cap`); `verify` applies the exact rule to a sequence's logits rows;
`observe` feeds the policy (acceptance per sequence and source).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast
from weakref import WeakKeyDictionary

import numpy as np

from llmopt.runtime.executors.step_batch import MAX_TREE_TOKENS, Executor, TreeExecutor
from llmopt.runtime.kv.manager import KVCacheManager
from llmopt.runtime.manifest import KVCacheSpec, Manifest, NgramDraftSpec, SpeculativeSpec
from llmopt.runtime.request import Request
from llmopt.runtime.scheduler import ScheduledRequest
from llmopt.runtime.speculative.cost_model import equivalent_alpha
from llmopt.runtime.speculative.drafter import (
    Drafter,
    FallbackDrafter,
    ModelDrafter,
    NgramDrafter,
    Proposal,
    SuffixDrafter,
)
from llmopt.runtime.speculative.policy import SpeculationPolicy
from llmopt.runtime.speculative.rejection_sampler import verify_drafts, verify_tree
from llmopt.runtime.speculative.step_cost import StepCostModel
from llmopt.runtime.speculative.suffix import SuffixSettings


@dataclass
class SpeculationTotals:
    """A sequence's counts for its metrics."""

    num_steps: int = 0  # steps that verified drafts
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # drafts accepted


class Speculator:
    def __init__(
        self,
        drafter: Drafter,
        gamma: int,
        max_batch_size: int | None = None,
        policy: SpeculationPolicy | None = None,
    ):
        """γ drafts at most per sequence and step, none while more than `max_batch_size`
        sequences run (None: any batch size). `policy` sizes each sequence's drafts from
        its acceptance and their cost (None: always γ)."""
        if gamma < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {gamma}")
        self.drafter = drafter
        self.gamma = gamma
        self.max_batch_size = max_batch_size
        self.policy = policy
        self.drafts: dict[str, Proposal] = {}  # this step's kept drafts, by request id
        self.totals: WeakKeyDictionary[Request, SpeculationTotals] = WeakKeyDictionary()

    def max_drafts(self, batch_size: int) -> Callable[[Request], int] | None:
        """This step's draft budget per sequence, for `batch_size` running sequences."""
        limit = self.max_batch_size
        if self.gamma == 0 or (limit is not None and batch_size > limit):
            return None
        policy = self.policy
        if policy is None:
            return lambda request: self.gamma
        return lambda request: min(self.gamma, policy.num_drafts(request))

    def propose(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """Fill the draft slots the scheduler reserved; give back the ones left unused."""
        self.drafts = {}
        speculating = [i for i, item in enumerate(scheduled) if item.num_spec_tokens]
        if not speculating:
            return scheduled
        requests = [scheduled[i].request for i in speculating]
        policy = self.policy  # prices each source's drafts before they are made
        proposals = self.drafter.propose(
            requests, [scheduled[i].num_spec_tokens for i in speculating],
            policy.num_drafts if policy is not None else None)
        drafted, others = self._drafted(scheduled, speculating, proposals)
        cap = self.policy.cap(drafted, others) if self.policy is not None else self.gamma
        scheduled = list(scheduled)
        for i, request, proposal in zip(speculating, requests, proposals, strict=True):
            kept = proposal.first(cap)
            if kept.token_ids:
                self.drafts[request.request_id] = kept
            unused = scheduled[i].num_spec_tokens - len(kept.token_ids)
            scheduled[i] = dataclasses.replace(
                scheduled[i], num_tokens=scheduled[i].num_tokens - unused,
                num_spec_tokens=len(kept.token_ids), spec_token_ids=tuple(kept.token_ids),
                spec_parents=(None if kept.parents is None or not kept.token_ids
                              else tuple(kept.parents)))
        return scheduled

    @staticmethod
    def _drafted(scheduled: list[ScheduledRequest], speculating: list[int],
                 proposals: list[Proposal]) -> tuple[list[tuple[Request, str, int]], list[int]]:
        """What the policy prices a step by (`SpeculationPolicy.cap`): each drafting
        sequence with its drafts' source and number, and the other rows' query lengths."""
        drafted = [(scheduled[i].request, p.source, len(p.token_ids))
                   for i, p in zip(speculating, proposals, strict=True) if p.token_ids]
        chosen = set(speculating)
        others = [item.num_tokens for i, item in enumerate(scheduled) if i not in chosen]
        others += [1] * (len(speculating) - len(drafted))  # reserved slots, no draft
        return drafted, others

    def verify(self, item: ScheduledRequest, logits: np.ndarray, target: Executor,
               kv_cache_manager: KVCacheManager) -> tuple[list[int], list[int]]:
        """The tokens a sequence with drafts emits (its accepted drafts plus one) and the
        indices of the logits rows they were drawn from (row j gave token j). An accepted
        side branch of a tree has its entries in `target`'s pools moved to the positions
        its tokens now have."""
        request = item.request
        tokens, path = self._verified(request, logits)
        if path != list(range(len(path))):  # a tree's side branch: its KV, its rows
            first = request.num_computed_tokens + item.num_tokens - item.num_spec_tokens
            moved = [(node, depth) for depth, node in enumerate(path) if node != depth]
            cast(TreeExecutor, target).move_entries(  # it ran the tree
                kv_cache_manager.block_ids(request), [first + node for node, _ in moved],
                [first + depth for _, depth in moved])
        return tokens, [0, *(node + 1 for node in path)]

    def _verified(self, request: Request, logits: np.ndarray) -> tuple[list[int], list[int]]:
        """The tokens emitted, and the accepted drafts' indices (a chain's: 0, 1, ...; a
        tree's: a branch)."""
        drafts = self.drafts[request.request_id]
        if drafts.parents is None:
            tokens = verify_drafts(logits, drafts.token_ids, drafts.probs,
                                   request.sampling_params, request.generator,
                                   request.all_token_ids)
            path = list(range(len(tokens) - 1))
        else:
            tokens, path = verify_tree(logits, drafts.token_ids, drafts.parents,
                                       request.sampling_params, request.generator,
                                       request.all_token_ids)
        totals = self.totals.setdefault(request, SpeculationTotals())
        totals.num_steps += 1
        totals.num_draft_tokens += len(drafts.token_ids)
        totals.num_accepted_tokens += len(tokens) - 1
        return tokens, path

    def observe(self, request: Request, emitted: Sequence[int]) -> None:
        """A decode step gave `request` these tokens: evidence for its acceptance record."""
        if self.policy is not None:
            drafts = self.drafts.get(request.request_id)
            num_drafts = len(drafts.token_ids) if drafts is not None else 0
            accepted = min(len(emitted) - 1, num_drafts)
            self.policy.observe(request, drafts.source if drafts is not None else "",
                                num_drafts, accepted)

    def totals_of(self, request: Request) -> SpeculationTotals:
        """The sequence's counts so far (zeros before its first verification)."""
        return self.totals.get(request) or SpeculationTotals()


# --- assembling an artifact's speculator ------------------------------------------------
ExecutorFor = Callable[[str, KVCacheSpec, int], Executor]


def build_speculator(
    path: Path,
    manifest: Manifest,
    kv_cache_manager: KVCacheManager,
    executor_for: ExecutorFor,
    *,
    enabled: bool = True,
    gamma: int | None = None,
    max_batch_size: int | None = None,
    adaptive: bool = True,
    drafts: str = "all",
    tree: bool = False,
) -> Speculator | None:
    """The artifact's speculator (None without a draft, when not `enabled`, or with
    γ = 0). `gamma` and `max_batch_size` override the compiler's choices;
    `adaptive=False`: always γ; `tree`: its suffix n-gram draft proposes trees."""
    spec = manifest.speculative if enabled else None
    gamma = gamma if gamma is not None else (spec.gamma if spec else 0)
    if gamma and spec is None:
        raise ValueError("num_speculative_tokens > 0 needs an artifact compiled with a draft "
                         "(a `draft` pass) and speculative=True")
    if tree and (spec is None or spec.ngram is None or spec.ngram.method != "suffix"
                 or drafts == "model"):
        raise ValueError("draft_tree needs speculation with the artifact's n-gram draft "
                         "of method: suffix")
    if tree and gamma >= MAX_TREE_TOKENS:
        raise ValueError(f"draft_tree verifies at most {MAX_TREE_TOKENS - 1} drafts a step "
                         f"(a tree mask's bits), got num_speculative_tokens={gamma}")
    if not gamma or spec is None:
        return None
    drafter = make_drafter(path, manifest, spec, kv_cache_manager, executor_for, drafts, tree)
    priced = adaptive and len(spec.verify_cost) >= gamma + 1  # the compiler measured costs
    policy = None
    if priced:
        prior = equivalent_alpha(spec.acceptance, gamma) if spec.acceptance else 0.5
        steps = StepCostModel.from_measured(spec.measured, spec.verify_cost)
        policy = SpeculationPolicy(gamma, spec.verify_cost, spec.cost_ratio or 0.0, prior,
                                   step_model=steps)
    limit = max_batch_size if max_batch_size is not None else spec.max_batch_size
    return Speculator(drafter, gamma, limit, policy)


def make_drafter(
    path: Path,
    manifest: Manifest,
    spec: SpeculativeSpec,
    kv_cache_manager: KVCacheManager,
    executor_for: ExecutorFor,
    drafts: str = "all",
    tree: bool = False,
) -> Drafter:
    """The artifact's drafter: n-gram lookup, its draft model, or n-gram falling back to it
    (`drafts`: "all" of those it has, only "ngram" or only "model"; `tree`: suffix
    n-gram drafts as trees)."""
    if drafts not in ("all", "ngram", "model"):
        raise ValueError(f"drafts must be 'all', 'ngram' or 'model', got {drafts!r}")
    if drafts != "all" and getattr(spec, drafts) is None:
        raise ValueError(f"drafts={drafts!r}, but the artifact has no {drafts} draft")
    model = None
    if spec.model is not None and drafts != "ngram":
        draft = spec.model
        token_map = None
        if draft.token_map is not None:
            token_map = np.load(path / draft.token_map).astype(np.int64)
            if token_map.shape != (draft.vocab_size,):
                raise ValueError(f"the draft's token map {draft.token_map} has shape "
                                 f"{token_map.shape}, expected ({draft.vocab_size},)")
        executor = executor_for(draft.graph, draft.kv_cache, draft.max_position)
        model = ModelDrafter(executor, kv_cache_manager, manifest.model.vocab_size, token_map)
    ngram = spec.ngram and drafts != "model" and make_ngram_drafter(path, spec.ngram,
                                                                     tree=tree)
    if ngram and model:
        return FallbackDrafter(ngram, model)
    if ngram or model:
        return ngram or model
    raise ValueError("the manifest's speculative section names neither an n-gram nor a "
                     "model draft")


def make_ngram_drafter(path: Path | None, spec: NgramDraftSpec,
                       corpus: np.ndarray | None = None,
                       tree: bool = False) -> NgramDrafter | SuffixDrafter:
    """The n-gram drafter `spec` describes; a suffix drafter's corpus is read from the
    artifact at `path` unless given; `tree`: it drafts trees."""
    if spec.method == "latest":
        return NgramDrafter(spec.min_n, spec.max_n)
    if corpus is None and spec.corpus is not None:
        if path is None:
            raise ValueError("a suffix drafter with a corpus file needs the artifact's path")
        corpus = np.load(path / spec.corpus)
        if corpus.ndim != 1 or not np.issubdtype(corpus.dtype, np.integer):
            raise ValueError(f"the n-gram corpus {spec.corpus} is not a 1-D array of token ids")
    settings = SuffixSettings(spec.min_n, spec.max_n, spec.min_confidence,
                              spec.length_per_match)
    return SuffixDrafter(settings, None if corpus is None else corpus.tolist(), tree)
