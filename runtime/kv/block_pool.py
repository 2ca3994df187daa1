"""BlockPool: the fixed set of KV-cache blocks, their reference counts and the prefix cache.

A block is the unit of KV storage: `block_size` consecutive token slots in every pool
tensor. Blocks are shared between sequences by reference count, and a FULL block whose
tokens are all computed gets a content hash that chains over every block before it, so a
new sequence whose prompt starts with the same tokens can reuse it (prefix caching).

Free blocks sit in an LRU queue: freeing appends to the tail, allocation pops from the
head. A freed block keeps its hash and contents until it is popped, so cached prefixes
survive as long as possible; `touch` takes such a block back out of the queue.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from llmopt.runtime.contract import NULL_BLOCK

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of a full block: its tokens chained onto the hash of the block before it."""
    # sha256 rather than Python's 64-bit hash(): a collision here would silently hand a
    # sequence someone else's keys and values.
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return digest.digest()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None  # set once, when the block is full and computed


class BlockPool:
    """`num_blocks` blocks; block 0 is the reserved null block and is never allocated."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(
                f"a block pool needs at least 2 blocks (block 0 is reserved), got {num_blocks}"
            )
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK].ref_count = 1  # owned by nobody, freed by nobody
        # Insertion-ordered set: head = least recently freed = next to be evicted.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached_blocks: dict[BlockHash, Block] = {}
        # Called with a block's id when it is handed out again: whatever an executor keeps
        # for the block's old contents (its sequence's attention sinks) is stale.
        self.reuse_listeners: list[Callable[[int], None]] = []
        # Called with a block's id when its last holder frees it (it keeps its contents).
        self.release_listeners: list[Callable[[int], None]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self.cached_blocks.get(block_hash)

    def allocate(self, num_blocks: int) -> list[Block]:
        """Pop `num_blocks` blocks from the head of the free queue, evicting their hashes."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(
                f"cannot allocate {num_blocks} KV blocks: only {self.num_free_blocks} are free "
                "(callers must check can_allocate first)"
            )
        allocated = []
        for _ in range(num_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            allocated.append(block)
        return allocated

    def take(self, block_ids: Iterable[int]) -> list[Block]:
        """Allocate these free blocks (the lanes layout decides which), evicting their hashes."""
        taken = []
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count:
                raise RuntimeError(f"block {block_id} is taken already")
            del self.free_queue[block_id]
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cached blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop a reference; blocks reaching zero join the tail of the queue in this order.

        Callers pass a sequence's blocks in reverse so the tail of a hash chain is evicted
        before its head: a prefix stays reusable as long as possible.
        """
        for block in blocks:
            if block.block_id == NULL_BLOCK or block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None
                for listener in self.release_listeners:
                    listener(block.block_id)

    def cache_full_block(self, block: Block, block_hash: BlockHash) -> None:
        """Record that `block` holds the full, computed tokens hashed by `block_hash`."""
        if block.block_hash is not None:
            return  # write-once: already registered (e.g. it was itself a cache hit)
        if block_hash in self.cached_blocks:
            return  # another block computed the same tokens first; keep that one
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def _evict(self, block: Block) -> None:
        for listener in self.reuse_listeners:
            listener(block.block_id)
        if block.block_hash is not None:
            del self.cached_blocks[block.block_hash]
            block.block_hash = None
