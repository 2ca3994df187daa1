"""Frequency n-gram drafting over more than the latest match (SuffixDecoding-style).

Prompt lookup copies what followed the LATEST earlier occurrence of the sequence's
suffix, as many tokens as asked. Here an index counts, for every context of 1..max_n
tokens, which token followed it how often: over the request's own tokens (prompt and
output so far, extended incrementally as tokens are accepted) and, optionally, over a
corpus the recipe named (tokenized into the artifact at compile time). A draft grows
one token at a time from the longest context found (the request's own counts before the
corpus's at equal length): the most frequent follower (the latest on ties), and stops
when the product of the followers' empirical frequencies falls below `min_confidence`
or the draft outgrows `length_per_match` × the first match's context length. So a long,
consistent match drafts far; a 1-token match that was followed by several different
tokens drafts little or nothing. Drafts are deterministic (exact verification treats
them as one-hot), so greedy outputs stay identical with speculation on and off.

`suffix_tree` drafts a tree instead: several followers per position, grown best-first
by the same frequency product, verified in one step under a tree attention mask.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Counts = dict[int, int]  # follower token -> count; insertion order = recency (latest last)


class NgramIndex:
    """Followers of every context of 1..max_n tokens of a growing token sequence."""

    def __init__(self, max_n: int, tokens: Sequence[int] = ()):
        self.max_n = max_n
        self.tokens: list[int] = []
        self.followers: dict[tuple[int, ...], Counts] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        seen, followers = self.tokens, self.followers
        for token in tokens:
            end = len(seen)
            for n in range(1, min(self.max_n, end) + 1):
                counts = followers.setdefault(tuple(seen[end - n:]), {})
                counts[token] = counts.pop(token, 0) + 1  # re-inserted: now the latest
            seen.append(token)

    def sync(self, tokens: Sequence[int]) -> None:
        """Index exactly `tokens`, which normally extend what is indexed (rebuilt if not)."""
        known = len(self.tokens)
        if len(tokens) < known or list(tokens[max(known - 1, 0):known]) != self.tokens[-1:]:
            self.tokens, self.followers = [], {}
            known = 0
        self.extend(tokens[known:])


@dataclass(frozen=True)
class SuffixSettings:
    min_n: int = 1
    max_n: int = 8
    min_confidence: float = 0.3  # stop drafting below this product of frequencies
    length_per_match: float = 1.0  # drafts allowed per token of matched context


def most_frequent(counts: Counts) -> tuple[int, int, int]:
    """(token, its count, total count); the latest of equally frequent followers."""
    best, best_count, total = -1, 0, 0
    for token, count in counts.items():
        total += count
        if count >= best_count:
            best, best_count = token, count
    return best, best_count, total


def longest_match(context: Sequence[int], indexes: Sequence[tuple[str, NgramIndex]],
                  settings: SuffixSettings) -> tuple[str, int, Counts] | None:
    """(index name, context length n, followers) of the longest suffix of `context`
    found, the earlier index first at equal length; None below `min_n`."""
    longest = min(settings.max_n, len(context))
    for n in range(longest, settings.min_n - 1, -1):
        key = tuple(context[len(context) - n:])
        for name, index in indexes:
            counts = index.followers.get(key) if n <= index.max_n else None
            if counts:
                return name, n, counts
    return None


def suffix_draft(context: Sequence[int], indexes: Sequence[tuple[str, NgramIndex]],
                 k: int, settings: SuffixSettings) -> tuple[list[int], str]:
    """Up to k draft tokens after `context`, and the source of the first ("ngram3": the
    request's own 3-token match, "corpus3": the corpus's); ([], "") when none."""
    tail = list(context[len(context) - settings.max_n:])
    draft: list[int] = []
    source, confidence, limit = "", 1.0, k
    while len(draft) < limit:
        match = longest_match(tail, indexes, settings)
        if match is None:
            break
        name, n, counts = match
        token, count, total = most_frequent(counts)
        confidence *= count / total
        if confidence < settings.min_confidence:
            break
        if not draft:  # the first match's length bounds the draft's
            source = f"{name}{n}"
            limit = min(k, max(1, int(settings.length_per_match * n)))
        draft.append(token)
        tail = (tail + [token])[-settings.max_n:]
    return draft, source


def suffix_tree(context: Sequence[int], indexes: Sequence[tuple[str, NgramIndex]],
                k: int, settings: SuffixSettings,
                followers: Callable[[Sequence[int]], Counts | None] | None = None,
                ) -> tuple[list[int], list[int], str]:
    """Up to k draft nodes after `context` as a tree: (tokens, parents, source), parents[i]
    the index of node i's parent (-1: it follows the context). Every candidate scores the
    product of its path's follower frequencies; the best are kept, best first, until k
    nodes or `min_confidence`, no deeper than `suffix_draft` would draft. Nodes come in
    depth-first order, each node's children by score (the earlier kept first among
    equals): following first children from node 0 gives the start of the chain
    `suffix_draft` would draft, as far as the budget reached. `followers(tokens)`: the
    candidates after `tokens` (None: the longest match's followers)."""
    tail = list(context[len(context) - settings.max_n:])  # all a lookup reads
    root = longest_match(tail, indexes, settings)
    if root is None or k <= 0:
        return [], [], ""
    if followers is None:
        def followers(tail: Sequence[int]) -> Counts | None:
            match = longest_match(tail, indexes, settings)
            return None if match is None else match[2]
    source, n, _ = root
    max_depth = min(k, max(1, int(settings.length_per_match * n)))
    paths: list[tuple[int, ...]] = []  # each kept node's tokens from the root
    scores: list[float] = []
    parents: list[int] = []
    candidates: list[tuple[float, int, int, int]] = []  # (-score, order, parent, token)

    def offer(counts: Counts, score: float, parent: int) -> None:
        total = sum(counts.values())
        for token, count in counts.items():  # later (more recent) first among equals
            heapq.heappush(candidates, (-score * count / total, -len(candidates), parent,
                                        token))

    offer(followers(tail) or {}, 1.0, -1)
    while candidates and len(paths) < k:
        negative, _, parent, token = heapq.heappop(candidates)
        if -negative < settings.min_confidence:
            break
        path = (paths[parent] if parent >= 0 else ()) + (token,)
        paths.append(path)
        scores.append(-negative)
        parents.append(parent)
        if len(path) < max_depth:
            counts = followers((tail + list(path))[-settings.max_n:])
            if counts:
                offer(counts, -negative, len(paths) - 1)
    if not paths:
        return [], [], ""
    order = _depth_first(parents, scores)
    index = {node: i for i, node in enumerate(order)}
    return ([paths[node][-1] for node in order],
            [index[parents[node]] if parents[node] >= 0 else -1 for node in order],
            f"{source}{n}")


def _depth_first(parents: list[int], scores: list[float]) -> list[int]:
    """Nodes in depth-first order, each node's children best first."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)

    def worst_first(nodes: list[int]) -> list[int]:
        return sorted(nodes, key=lambda node: (scores[node], -node))

    order: list[int] = []
    stack = worst_first(children.get(-1, []))
    while stack:  # the best child is on top
        node = stack.pop()
        order.append(node)
        stack += worst_first(children.get(node, []))
    return order
