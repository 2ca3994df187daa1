"""LaneKVCacheManager: block tables for the lanes KV layout.

The pool is cut into lanes of `lane_blocks` blocks; a running request owns one lane, and
its block j is its lane's block j, so its keys and values are contiguous and the graph's
fused attention reads them in place (see `llmopt.runtime.contract`). Block ids, hashes,
the prefix cache and preemption work as with free placement, with one difference: a
prefix-cache hit held by another lane is copied into the request's own lane (every
executor's `copy_block`, at admission), which costs a memcpy instead of the prefill.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llmopt.runtime.kv.block_pool import Block
from llmopt.runtime.kv.manager import KVCacheManager
from llmopt.runtime.kv.paging import cdiv, lane_block, lane_position, num_lanes
from llmopt.runtime.request import Request

CopyBlock = Callable[[int, int], None]  # (source block id, destination block id)


class LaneKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, lane_blocks: int,
                 enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.lane_blocks = lane_blocks
        self.num_lanes = num_lanes(num_blocks, lane_blocks)
        self.lanes: dict[str, int] = {}  # request id -> its lane
        self.free_lanes: set[int] = set(range(self.num_lanes))
        self.copy_listeners: list[CopyBlock] = []  # every executor that holds pool tensors

    def lane_block(self, lane: int, index: int) -> int:
        return lane_block(lane, index, self.lane_blocks)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[Block] = ()
    ) -> bool:
        table = self.block_tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        lane = self.lanes.get(request.request_id)
        if num_required > self.lane_blocks or (lane is None and not self.free_lanes):
            return False
        if lane is None:
            lane = self._assign_lane(request, new_computed_blocks)
            table = self.block_tables[request.request_id]
        own = range(len(table), num_required)
        table.extend(self.block_pool.take(self.lane_block(lane, j) for j in own))
        return True

    def free(self, request: Request) -> None:
        super().free(request)
        lane = self.lanes.pop(request.request_id, None)
        if lane is not None:
            self.free_lanes.add(lane)

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
