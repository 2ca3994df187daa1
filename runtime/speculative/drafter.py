"""Drafters: what proposes the tokens a speculative step verifies.

`NgramDrafter` looks the sequence's own recent tokens up earlier in it (prompt lookup);
`SuffixDrafter` drafts from follower counts over the sequence and a corpus (`suffix`);
`ModelDrafter` runs the artifact's draft graph; `FallbackDrafter` tries the first and
asks the second for the sequences it has nothing for. A proposal carries the
distributions its tokens were drawn from, which exact verification needs (None: the
tokens were chosen deterministically).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol
from weakref import WeakKeyDictionary

import numpy as np

from llmopt.runtime.executors.step_batch import Executor, SequenceStep, StepBatch, make_step_batch
from llmopt.runtime.kv.manager import KVCacheManager, TrailingKV
from llmopt.runtime.request import Request
from llmopt.runtime.sampler import draw, sample, token_probs
from llmopt.runtime.speculative.suffix import NgramIndex, SuffixSettings, suffix_draft, suffix_tree


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]
    probs: np.ndarray | None = None  # float64 [len(token_ids), target vocab]; None: one-hot
    source: str = ""  # what drafted it ("ngram3": a 3-token match, "model"), priced apart
    parents: list[int] | None = None  # a draft tree's parent of each token; None: a chain

    def first(self, count: int) -> Proposal:
        """The proposal cut to its first `count` tokens (a tree's stay a tree: parents
        come before their children)."""
        return Proposal(self.token_ids[:count],
                        None if self.probs is None else self.probs[:count], self.source,
                        None if self.parents is None else self.parents[:count])


# How many drafts a request may take from a source (the engine's per-sequence policy);
# asked before a model drafts, so that no draft step is spent on tokens nobody verifies.
Budget = Callable[[Request, str], int]


class Drafter(Protocol):
    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int],
                budget: Budget | None = None) -> list[Proposal]:
        """Up to `max_tokens[i]` draft tokens for each request, after its known tokens,
        and no more than `budget` allows for their source."""
        ...


class NgramDrafter:
    """Prompt lookup: the longest suffix (max_n down to min_n tokens) of the sequence that
    occurred earlier in it proposes the tokens that followed its latest occurrence."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram drafting needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def lookup(self) -> Callable[[Sequence[int], int], list[int]]:
        """A draft function for one growing sequence (the compile-time simulation's)."""
        return lambda token_ids, k: ngram_lookup(token_ids, self.min_n, self.max_n, k)

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int],
                budget: Budget | None = None) -> list[Proposal]:
        proposals = []
        for request, k in zip(requests, max_tokens, strict=True):
            tokens, n = ngram_match(request.all_token_ids, self.min_n, self.max_n, k) if k \
                else ([], 0)
            source = f"ngram{n}"
            if tokens and budget is not None:
                tokens = tokens[: budget(request, source)]
            proposals.append(Proposal(tokens, source=source))
        return proposals


def ngram_match(token_ids: Sequence[int], min_n: int, max_n: int,
                k: int) -> tuple[list[int], int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix,
    and that suffix's length (0: no match)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, tokens.size - 1), min_n - 1, -1):
        # Windows end before the last token, so a match is always followed by something.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist(), n
    return [], 0


def ngram_lookup(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    return ngram_match(token_ids, min_n, max_n, k)[0]


class SuffixDrafter:
    """Frequency n-gram drafting over the sequence's own tokens and an optional corpus
    (`suffix.suffix_draft`); each sequence's index is kept here while the sequence lives.
    With `tree`, each proposal is a draft tree (`suffix.suffix_tree`) of as many tokens."""

    def __init__(self, settings: SuffixSettings, corpus: Sequence[int] | None = None,
                 tree: bool = False):
        self.settings = settings
        self.corpus = None if corpus is None else NgramIndex(settings.max_n, corpus)
        self.tree = tree
        self.indexes: WeakKeyDictionary[Request, NgramIndex] = WeakKeyDictionary()

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int],
                budget: Budget | None = None) -> list[Proposal]:
        proposals = []
        for request, k in zip(requests, max_tokens, strict=True):
            proposal = self.propose_one(request, k) if k else Proposal([])
            if proposal.token_ids and budget is not None:
                proposal = proposal.first(budget(request, proposal.source))
            proposals.append(proposal)
        return proposals

    def propose_one(self, request: Request, k: int) -> Proposal:
        """Up to k draft tokens after the request's tokens (a tree with `tree`); its own
        index is kept for the next step."""
        index = self.indexes.get(request)
        if index is None:
            index = self.indexes[request] = NgramIndex(self.settings.max_n)
        tokens = request.all_token_ids
        indexes = self._synced(tokens, index)
        if self.tree:
            nodes, parents, source = suffix_tree(tokens, indexes, k, self.settings)
            return Proposal(nodes, source=source, parents=parents)
        drafted, source = suffix_draft(tokens, indexes, k, self.settings)
        return Proposal(drafted, source=source)

    def lookup(self) -> Callable[[Sequence[int], int], list[int]]:
        """A draft function for one growing sequence (the compile-time simulation's)."""
        index = NgramIndex(self.settings.max_n)
        return lambda token_ids, k: suffix_draft(token_ids, self._synced(token_ids, index), k,
                                                 self.settings)[0]

    def _synced(self, token_ids: Sequence[int],
                index: NgramIndex) -> list[tuple[str, NgramIndex]]:
        """`index` synced to `token_ids`, and the corpus's index after it."""
        index.sync(token_ids)  # its own suffix has no follower yet: no self-match
        return [("ngram", index)] + ([("corpus", self.corpus)] if self.corpus else [])


class ModelDrafter:
    """Runs the draft graph on its own KV pool, through the target's block tables.

    Its pool fills behind the target's (`TrailingKV` counts the leading tokens of each
    request whose draft KV is in the pool). A proposal first catches the draft up with the
    known tokens (after a prefill, or after the target accepted tokens the draft never
    saw), then runs one token at a time; the slots it writes are those the scheduler
    allocated for the target's verification of the same positions.
    """

    def __init__(
        self,
        executor: Executor,
        kv_cache_manager: KVCacheManager,
        target_vocab_size: int,
        token_map: np.ndarray | None = None,
    ):
        self.executor = executor
        self.kv_cache_manager = kv_cache_manager
        self.trailing: TrailingKV = kv_cache_manager.trail()
        self.target_vocab_size = target_vocab_size
        self.token_map = token_map  # draft logits row -> target token id; None = identity

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int],
                budget: Budget | None = None) -> list[Proposal]:
        if budget is not None:
            max_tokens = [min(k, budget(r, "model")) if k else 0
                          for r, k in zip(requests, max_tokens, strict=True)]
        active = [i for i, k in enumerate(max_tokens) if k > 0]
        drafts: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[np.ndarray]] = {i: [] for i in active}
        step = 0
        while active:
            batch = self._step_batch([requests[i] for i in active], [drafts[i] for i in active])
            logits = self.executor.execute(batch)
            for row, i in enumerate(active):
                request = requests[i]
                self.trailing.set_computed(request, request.num_tokens + step)
                token, q = self._draw(logits[row], request, drafts[i])
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
            step += 1
            active = [i for i in active if len(drafts[i]) < max_tokens[i]]
        return [
            Proposal(drafts.get(i, []), np.stack(probs[i]) if probs.get(i) else None, "model")
            for i in range(len(requests))
        ]

    def _step_batch(self, requests: list[Request], drafts: list[list[int]]) -> StepBatch:
        """Each request's tokens the draft has not computed: known ones, then its drafts
        except the newest (whose logits are what this step asks for)."""
        sequences = []
        for request, draft in zip(requests, drafts, strict=True):
            start = self.trailing.num_computed(request)
            tokens = (request.all_token_ids + draft)[start:]
            kv = self.kv_cache_manager
            sequences.append(SequenceStep(tokens, start, kv.block_ids(request),
                                          [len(tokens) - 1],
                                          local_block_table=kv.local_block_ids(request)))
        return make_step_batch(sequences, self.kv_cache_manager.block_size)

    def _draw(
        self, logits: np.ndarray, request: Request, draft: list[int]
    ) -> tuple[int, np.ndarray | None]:
        """The next draft token, and the distribution it came from (None for greedy)."""
        logits = self._in_target_ids(logits)
        params, seen = request.sampling_params, request.all_token_ids + draft
        if params.greedy:
            return int(sample(logits[None, :], [params], [request.generator], [seen])[0]), None
        q = token_probs(logits, params, seen)
        return draw(q, request.generator), q

    def _in_target_ids(self, logits: np.ndarray) -> np.ndarray:
        """Draft logits over the target's vocabulary: tokens the draft lacks get -inf."""
        if self.token_map is None:
            return logits
        full = np.full(self.target_vocab_size, -np.inf, dtype=np.float32)
        full[self.token_map] = logits
        return full


class FallbackDrafter:
    """Ask `first` (cheap, e.g. n-gram lookup); ask `second` for what it left empty."""

    def __init__(self, first: Drafter, second: Drafter):
        self.first, self.second = first, second

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int],
                budget: Budget | None = None) -> list[Proposal]:
        proposals = self.first.propose(requests, max_tokens, budget)
        missing = [i for i, p in enumerate(proposals) if not p.token_ids and max_tokens[i]]
        if missing:
            extra = self.second.propose([requests[i] for i in missing],
                                        [max_tokens[i] for i in missing], budget)
            for i, proposal in zip(missing, extra, strict=True):
                proposals[i] = proposal
        return proposals
