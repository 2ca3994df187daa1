import pytest

from llmopt.runtime.kv.block_pool import BlockPool, hash_block_tokens


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.free_queue)


def test_allocate_pops_from_head_and_never_hands_out_the_null_block():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert all(b.ref_count == 1 for b in blocks)
    assert free_order(pool) == [4, 5]
    assert pool.blocks[0].ref_count == 1  # the null block is permanently owned


def test_free_appends_to_tail_in_the_order_given():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    pool.free(reversed(blocks))  # how the manager frees a sequence: tail first
    assert free_order(pool) == [4, 5, 3, 2, 1]
    assert [b.block_id for b in pool.allocate(5)] == [4, 5, 3, 2, 1]


def test_allocating_more_than_free_fails_loudly():
    pool = BlockPool(4)
    pool.allocate(2)
    assert not pool.can_allocate(2)
    with pytest.raises(RuntimeError, match="cannot allocate 2 KV blocks: only 1 are free"):
        pool.allocate(2)


def test_pool_needs_a_usable_block():
    for num_blocks in (0, 1):
        with pytest.raises(ValueError, match="at least 2 blocks"):
            BlockPool(num_blocks)


def test_shared_block_is_freed_only_when_last_reference_drops():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.touch([block])
    assert block.ref_count == 2
    pool.free([block])
    assert block.ref_count == 1 and 1 not in pool.free_queue
    pool.free([block])
    assert block.ref_count == 0 and free_order(pool) == [2, 3, 1]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([block])


def test_freed_cached_block_stays_cached_until_evicted():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_full_block(a, h)
    pool.free([b, a])
    assert free_order(pool) == [3, 2, 1]
    assert pool.get_cached_block(h) is a

    # A hit takes the block out of the free queue without touching the others.
    pool.touch([a])
    assert a.ref_count == 1 and free_order(pool) == [3, 2]
    pool.free([a])
    assert free_order(pool) == [3, 2, 1]

    # Allocation reaches it last (LRU) and only then evicts its hash.
    assert [x.block_id for x in pool.allocate(2)] == [3, 2]
    assert pool.get_cached_block(h) is a
    assert [x.block_id for x in pool.allocate(1)] == [1]
    assert pool.get_cached_block(h) is None and a.block_hash is None


def test_block_hash_is_write_once_and_first_block_wins():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    h1, h2 = hash_block_tokens(None, [1]), hash_block_tokens(None, [2])
    pool.cache_full_block(a, h1)
    pool.cache_full_block(a, h2)  # ignored: a block's hash never changes
    assert a.block_hash == h1 and pool.get_cached_block(h2) is None
    pool.cache_full_block(b, h1)  # same contents computed twice: keep the first block
    assert pool.get_cached_block(h1) is a and b.block_hash is None


def test_hash_chains_over_parents():
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(first, [3, 4]) == hash_block_tokens(first, [3, 4])
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
