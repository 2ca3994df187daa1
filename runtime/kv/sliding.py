"""SlidingBlocks: the blocks of the sliding-window layers, freed once behind every window.

A sliding-window layer never reads a key `window` or more positions before its query, so
a block that ends before the oldest position a sequence's next query can see holds nothing
such a layer reads again. Those layers keep their keys and values in pools of their own
(the local group, as vLLM v1 keeps sliding-window layers in their own block group): each
request has a local block table parallel to its full one, whose entries behind the window
are given back to the local block pool (None; a step reads block 0 there, which the
window's mask hides).

Prefix caching works as for the full table, with the same chained hashes: a hit of k
blocks also needs here the cached local blocks that the window of position k*bs reaches.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmopt.runtime.contract import NULL_BLOCK
from llmopt.runtime.kv.block_pool import Block, BlockHash, BlockPool


class SlidingBlocks:
    def __init__(self, num_blocks: int, block_size: int, window: int):
        if window < 1:
            raise ValueError(f"a sliding window must hold at least 1 position, got {window}")
        self.block_pool = BlockPool(num_blocks)
        self.block_size, self.window = block_size, window
        self.tables: dict[str, list[Block | None]] = {}
        self.num_cached: dict[str, int] = {}  # leading entries registered in the cache

    def first_visible(self, position: int) -> int:
        """Index of the first block a query at `position` may read."""
        return max(position - self.window + 1, 0) // self.block_size

    def usable_hits(self, hashes: Sequence[BlockHash], num_hits: int
                    ) -> tuple[int, list[Block]]:
        """The longest k <= num_hits full-table hits whose window is cached here too, and
        the local blocks of that window (indices first_visible(k * bs) .. k - 1)."""
        for k in range(num_hits, 0, -1):
            first = self.first_visible(k * self.block_size)
            blocks = [self.block_pool.get_cached_block(h) for h in hashes[first:k]]
            if all(block is not None for block in blocks):
                return k, blocks  # type: ignore[return-value]
        return 0, []

    def allocate(self, request_id: str, hashes: Sequence[BlockHash], num_hits: int,
                 num_required: int) -> bool:
        """Grow the request's local table to `num_required` entries (at admission, after
        its `num_hits` prefix-cache hits); False, changing nothing, if blocks run out."""
        table = self.tables.get(request_id)
        hits: list[Block] = []
        if table is None:
            num_usable, hits = self.usable_hits(hashes, num_hits)
            if num_usable != num_hits:
                raise RuntimeError(f"{num_hits} prefix-cache hits, of which the local blocks "
                                   f"of only {num_usable} are cached")
        have = len(table) if table is not None else num_hits
        num_new = max(num_required - have, 0)
        num_free_hits = sum(1 for block in hits if block.ref_count == 0)
        if not self.block_pool.can_allocate(num_new + num_free_hits):
            return False
        if table is None:
            self.block_pool.touch(hits)
            table = self.tables[request_id] = [None] * (num_hits - len(hits)) + list(hits)
            self.num_cached[request_id] = num_hits
        table.extend(self.block_pool.allocate(num_new))
        return True

    def cache_and_free(self, request_id: str, hashes: Sequence[BlockHash] | None,
                       num_full: int, next_position: int) -> None:
        """Register the request's blocks full of computed tokens (`hashes`: None without
        prefix caching), then give back those no query from `next_position` on can see."""
        table = self.tables[request_id]
        first = self.num_cached.get(request_id, 0)
        if hashes is not None and num_full > first:
            for i in range(first, num_full):
                block = table[i]
                if block is not None:
                    self.block_pool.cache_full_block(block, hashes[i])
            self.num_cached[request_id] = num_full
        behind = [i for i in range(min(self.first_visible(next_position), len(table)))
                  if table[i] is not None]
        self.block_pool.free(table[i] for i in behind)  # oldest first: evicted first
        for i in behind:
            table[i] = None

    def free(self, request_id: str) -> None:
        """Release the request's local blocks, tail first (as the full table's)."""
        table = self.tables.pop(request_id, [])
        self.num_cached.pop(request_id, None)
        self.block_pool.free(block for block in reversed(table) if block is not None)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's local table; NULL_BLOCK where a block was given back."""
        return [NULL_BLOCK if block is None else block.block_id
                for block in self.tables.get(request_id, [])]

    def num_held(self, request_id: str) -> int:
        """Local blocks the request holds now."""
        return sum(1 for block in self.tables.get(request_id, []) if block is not None)

    @property
    def num_used_blocks(self) -> int:
        """Local blocks some request holds (block 0 excluded)."""
        return len(self.block_pool.blocks) - 1 - self.block_pool.num_free_blocks
