"""KVCacheManager: each request's block table on top of the BlockPool, and its slot mapping.

A request's token at position p lives at slot `block_table[p // block_size] * block_size
+ p % block_size`. Its table grows as tokens are scheduled; a new request may start from
blocks another request already computed (prefix caching of full blocks).

With `lane_blocks` (the lanes KV layout) the pool is cut into lanes of `lane_blocks`
blocks; a running request owns one lane, and its block j is its lane's block j, so its
keys and values are contiguous and the graph's fused attention reads them in place (see
`llmopt.runtime.contract`). Block ids, hashes, the prefix cache and preemption work as
with free placement, with one difference: a prefix-cache hit held by another lane is
copied into the request's own lane (every attached graph's pools, at admission),
which costs a memcpy instead of the prefill.

A graph may fill its pools behind the target's over the same tables (`trail`): a model
that proposes tokens past the target's computes them from the target's known tokens, and
only after the target does. `TrailingKV` records how far it has come per request and
which cached blocks it holds in full, so that a prefix-cache hit spares it those too.

With `sliding` (free placement only) the sliding-window layers that read a local block
table have blocks of their own, given back once behind their window (`SlidingBlocks`).

With `streaming` (lanes only) a request keeps attention sinks and a window in its lane:
before a step would overrun them the oldest entries after the sinks are dropped
(`StreamingKV`; with H2O, those of least accumulated attention: `H2OKV`), and the
request's entries sit at its cache positions, its computed tokens less those dropped
(`cache_position`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from llmopt.runtime.kv.block_pool import Block, BlockPool, hash_block_tokens
from llmopt.runtime.kv.h2o import H2OKV
from llmopt.runtime.kv.paging import cdiv, lane_block, lane_position, num_lanes, slots_of
from llmopt.runtime.kv.pools import BlockPools, KVPools
from llmopt.runtime.kv.sliding import SlidingBlocks
from llmopt.runtime.kv.streaming import StreamingKV
from llmopt.runtime.request import Request

CopyBlock = Callable[[int, int], None]  # (source block id, destination block id)


@dataclass(eq=False)
class TrailingKV:
    """The KV of a graph that computes a request's tokens after the target does, over the
    same block tables."""

    computed: dict[str, int] = field(default_factory=dict)  # request id -> leading tokens held
    full_blocks: set[int] = field(default_factory=set)  # cached blocks it holds in full
    num_recorded: dict[str, int] = field(default_factory=dict)  # request id -> blocks looked at

    def num_computed(self, request: Request) -> int:
        """Leading known tokens of `request` whose entries its pools hold."""
        return self.computed.get(request.request_id, 0)

    def set_computed(self, request: Request, num_tokens: int) -> None:
        self.computed[request.request_id] = num_tokens


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 lane_blocks: int | None = None, sliding: SlidingBlocks | None = None):
        """`lane_blocks`: the lanes layout's lane length in blocks (None: free placement);
        `sliding`: the local group of sliding-window layers (None: none)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding is not None and lane_blocks is not None:
            raise ValueError("sliding-window blocks need free placement (the blocks layout)")
        self.sliding = sliding
        # Whether a trailing graph reads the local table too: then its blocks are freed
        # behind the trailing graph's position, which may lag the target's.
        self.sliding_trails = False
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[Block]] = {}
        self.lane_blocks = lane_blocks
        if lane_blocks is not None:
            self.num_lanes = num_lanes(num_blocks, lane_blocks)
            self.lanes: dict[str, int] = {}  # request id -> its lane
            self.free_lanes: set[int] = set(range(self.num_lanes))
        self.pools: list[KVPools] = []  # every graph's KV pools (`attach`)
        self.copy_listeners: list[CopyBlock] = []  # called for lanes' prefix-hit copies
        # How many leading blocks of each request are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.trailing: TrailingKV | None = None  # `trail`
        # an eviction policy, set with the lanes layout only
        self.streaming: StreamingKV | H2OKV | None = None

    def trail(self) -> TrailingKV:
        """Track a graph whose pools fill behind the target's (see the module's note)."""
        self.trailing = TrailingKV()
        self.block_pool.reuse_listeners.append(self.trailing.full_blocks.discard)
        return self.trailing

    def attach(self, pools: KVPools) -> None:
        """Keep a graph's pools in step with the tables: lanes' prefix-hit copies, and the
        rows the blocks layout keeps per block (sinks, tails) dropped when a block is reused."""
        self.pools.append(pools)
        if self.lane_blocks is not None:
            self.copy_listeners.append(pools.copy_block)
        if isinstance(pools, BlockPools):
            self.block_pool.reuse_listeners.append(pools.forget_block)
            self.block_pool.release_listeners.append(pools.release_block)

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest run of cached full blocks that starts the request's known tokens.

        Returns the blocks and the number of tokens they hold. The block holding the last
        known token is never reused: that token must be computed to produce logits.
        """
        if not self.enable_prefix_caching or request.score_only:
            return [], 0  # scoring needs logits at every position, so computes them all
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        hashes = self._block_hashes(request)
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        if self.sliding is not None:  # the local layers need their window's blocks too
            del blocks[self.sliding.usable_hits(hashes, len(blocks))[0]:]
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[Block] = ()
    ) -> bool:
        """Grow the block table to hold `num_new_tokens` more tokens; False if blocks run out.

        `new_computed_blocks` are prefix-cache hits from `get_computed_blocks` for a
        request being admitted; they go first in its table.
        """
        admitted = request.request_id not in self.block_tables
        allocated = (self._allocate_in_lane(request, num_new_tokens, new_computed_blocks)
                     if self.lane_blocks is not None
                     else self._allocate(request, num_new_tokens, new_computed_blocks))
        if allocated and admitted and self.trailing is not None:
            self._trail_hits(request, new_computed_blocks)
        return allocated

    def _allocate(self, request: Request, num_new_tokens: int,
                  new_computed_blocks: Sequence[Block]) -> bool:
        """`allocate_slots` with free placement: any free blocks, hits shared in place."""
        table = self.block_tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(num_required - len(table) - len(new_computed_blocks), 0)
        # A cache hit that sits in the free queue stops being free once we take it.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_count == 0)
        if not self.block_pool.can_allocate(num_new_blocks + num_free_hits):
            return False
        if self.sliding is not None and not self.sliding.allocate(
                request.request_id, self._block_hashes(request) if new_computed_blocks else [],
                len(new_computed_blocks), num_required):
            return False

        self.block_pool.touch(new_computed_blocks)
        table = self.block_tables.setdefault(request.request_id, [])
        table.extend(new_computed_blocks)
        table.extend(self.block_pool.allocate(num_new_blocks))
        cached = self.num_cached_blocks.get(request.request_id, 0)
        self.num_cached_blocks[request.request_id] = cached + len(new_computed_blocks)
        return True

    def cache_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens (and those
        a trailing graph holds in full too: a later hit spares it them)."""
        trailing = self.trailing
        if trailing is not None:  # past the target's computed tokens it holds none it kept
            trailing.set_computed(request, min(trailing.num_computed(request),
                                               request.num_computed_tokens))
        if self.sliding is not None:
            self._slide(request)
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        first = self.num_cached_blocks.get(request.request_id, 0)
        table = self.block_tables[request.request_id]
        if num_full > first:
            hashes = self._block_hashes(request)
            for i in range(first, num_full):
                self.block_pool.cache_full_block(table[i], hashes[i])
            self.num_cached_blocks[request.request_id] = num_full
        if trailing is not None:
            self._record_trailing(trailing, request, table, num_full)

    def _slide(self, request: Request) -> None:
        """Register the local blocks now full, and free those behind every next query."""
        assert self.sliding is not None
        next_position = request.num_computed_tokens
        if self.sliding_trails and self.trailing is not None:
            next_position = min(next_position, self.trailing.num_computed(request))
        num_full = request.num_computed_tokens // self.block_size
        hashes = self._block_hashes(request) if self.enable_prefix_caching else None
        self.sliding.cache_and_free(request.request_id, hashes, num_full, next_position)

    def _record_trailing(self, trailing: TrailingKV, request: Request, table: list[Block],
                         num_full: int) -> None:
        """Note the request's cached blocks the trailing graph now holds in full."""
        held = min(num_full, trailing.num_computed(request) // self.block_size)
        first = trailing.num_recorded.get(request.request_id, 0)
        for block in table[first:held]:
            if block.block_hash is not None:
                trailing.full_blocks.add(block.block_id)
            else:
                trailing.full_blocks.discard(block.block_id)
        trailing.num_recorded[request.request_id] = max(first, held)

    def _trail_hits(self, request: Request, hits: Sequence[Block]) -> None:
        """An admitted request: the trailing graph holds the leading hits it holds in full."""
        trailing = self.trailing
        assert trailing is not None
        held = 0
        while held < len(hits) and hits[held].block_id in trailing.full_blocks:
            held += 1
        trailing.set_computed(request, held * self.block_size)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so shared prefixes are evicted last."""
        table = self.block_tables.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        if self.trailing is not None:
            self.trailing.computed.pop(request.request_id, None)
            self.trailing.num_recorded.pop(request.request_id, None)
        self.block_pool.free(reversed(table))
        if self.sliding is not None:
            self.sliding.free(request.request_id)
        lane = self.lanes.pop(request.request_id, None) if self.lane_blocks is not None else None
        if self.streaming is not None:
            self.streaming.forget(request.request_id, lane)
        if lane is not None:
            self.free_lanes.add(lane)

    def block_ids(self, request: Request) -> list[int]:
        return [block.block_id for block in self.block_tables.get(request.request_id, [])]

    def local_block_ids(self, request: Request) -> list[int] | None:
        """The request's local block table (None without sliding-window blocks)."""
        return None if self.sliding is None else self.sliding.block_ids(request.request_id)

    def blocks_held(self, request: Request) -> dict[str, int]:
        """Blocks the request holds now, per layer group ("full", and "sliding" if any)."""
        held = {"full": len(self.block_tables.get(request.request_id, []))}
        if self.sliding is not None:
            held["sliding"] = self.sliding.num_held(request.request_id)
        return held

    def cache_position(self, request: Request) -> int:
        """Where the request's next token goes in its entries: its computed tokens, less
        those a streaming request dropped."""
        if self.streaming is None:
            return request.num_computed_tokens
        return request.num_computed_tokens - self.streaming.num_evicted(request.request_id)

    def slot_mapping(self, request: Request, start: int, num_tokens: int) -> np.ndarray:
        """Pool slots of positions start .. start + num_tokens - 1 of the request."""
        return np.asarray(slots_of(self.block_ids(request), start, num_tokens, self.block_size),
                          dtype=np.int64)

    # The lanes layout (lane_blocks set).
    def lane_block(self, lane: int, index: int) -> int:
        return lane_block(lane, index, self.lane_blocks)

    def _allocate_in_lane(self, request: Request, num_new_tokens: int,
                          new_computed_blocks: Sequence[Block]) -> bool:
        """`allocate_slots` in the lanes layout: the request's table runs through its lane."""
        table = self.block_tables.get(request.request_id, [])
        num_computed = self.cache_position(request) + len(new_computed_blocks) * self.block_size
        lane = self.lanes.get(request.request_id)
        if self.streaming is not None and lane is not None:
            num_computed -= self._drop(request, lane, num_computed, num_new_tokens)
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        if num_required > self.lane_blocks or (lane is None and not self.free_lanes):
            return False
        if lane is None:
            lane = self._assign_lane(request, new_computed_blocks)
            table = self.block_tables[request.request_id]
        own = range(len(table), num_required)
        table.extend(self.block_pool.take(self.lane_block(lane, j) for j in own))
        return True

    def _drop(self, request: Request, lane: int, cached: int, num_new_tokens: int) -> int:
        """Streaming: drop the entries a step of `num_new_tokens` would overrun, and give
        back the lane's blocks they emptied; how many positions were dropped."""
        assert self.streaming is not None
        drop = self.streaming.to_drop(cached, num_new_tokens)
        if drop:
            self.streaming.drop(request.request_id, self.pools, lane, cached, drop)
            table = self.block_tables[request.request_id]
            keep = cdiv(cached - drop, self.block_size)
            self.block_pool.free(reversed(table[keep:]))
            del table[keep:]
        return drop

    def _assign_lane(self, request: Request, hits: Sequence[Block]) -> int:
        """Give `request` a free lane, its table starting with the prefix-cache hits:
        in place where the lane holds them, copied from their lanes otherwise."""
        lane = self._pick_lane(hits)
        self.free_lanes.remove(lane)
        self.lanes[request.request_id] = lane
        table = self.block_tables.setdefault(request.request_id, [])
        for index, hit in enumerate(hits):
            own = self.lane_block(lane, index)
            if hit.block_id == own:
                self.block_pool.touch([hit])
                table.append(hit)
                continue
            [block] = self.block_pool.take([own])
            for copy in self.copy_listeners:
                copy(hit.block_id, own)
            table.append(block)
        self.num_cached_blocks[request.request_id] = len(hits)
        return lane

    def _pick_lane(self, hits: Sequence[Block]) -> int:
        """The free lane holding most of the hits in place; else the lowest free lane that
        caches nothing; else the lowest free lane.

        A step runs as one graph call over the lanes from its lowest running lane to its
        highest, and every idle lane in between still costs a row of every matmul (at
        int8 activations about as much as a real one): taking the lowest lanes keeps the
        running ones packed. Empty lanes go first so that cached prefixes live longest;
        once every free lane caches something, the lowest one's prefix is given up.
        """
        in_place: dict[int, int] = {}
        for index, hit in enumerate(hits):
            lane, offset = lane_position(hit.block_id, self.lane_blocks)
            if offset == index and lane in self.free_lanes:
                in_place[lane] = in_place.get(lane, 0) + 1
        if in_place:
            return max(in_place, key=in_place.__getitem__)
        empty = [lane for lane in self.free_lanes
                 if self.block_pool.blocks[self.lane_block(lane, 0)].block_hash is None]
        return min(empty or self.free_lanes)

    def _block_hashes(self, request: Request) -> list[bytes]:
        """The request's chained block hashes, extended over every full block of known tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[i - 1] if i > 0 else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs]))
        return hashes
