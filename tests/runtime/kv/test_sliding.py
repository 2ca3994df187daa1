"""SlidingBlocks and the manager's local block tables: exact block ids, freeing, hits."""

from __future__ import annotations

import pytest

from llmopt.runtime.kv.manager import KVCacheManager
from llmopt.runtime.kv.sliding import SlidingBlocks
from llmopt.runtime.request import Request
from llmopt.runtime.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=100))


def manager(window: int = 6, num_blocks: int = 40, local_blocks: int = 12,
            caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, caching,
                          sliding=SlidingBlocks(local_blocks, 4, window))


def run_to(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Schedule and compute the request's tokens up to `num_tokens`, one step."""
    new = num_tokens - request.num_computed_tokens
    assert kv.allocate_slots(request, new)
    request.num_computed_tokens = num_tokens
    kv.cache_blocks(request)


def test_blocks_behind_the_window_are_given_back():
    kv = manager(window=6)
    request = make_request("a", list(range(3, 23)))  # 20 tokens: five blocks
    run_to(kv, request, 20)
    # The next query (position 20) sees positions 15..20: blocks 3 and 4 only.
    assert kv.local_block_ids(request) == [0, 0, 0, 4, 5]
    assert kv.block_ids(request) == [1, 2, 3, 4, 5]
    assert kv.blocks_held(request) == {"full": 5, "sliding": 2}
    assert kv.sliding.num_used_blocks == 2


def test_the_local_group_holds_a_window_however_long_the_sequence():
    kv = manager(window=6, num_blocks=60, local_blocks=5)
    request = make_request("a", list(range(3, 203)))
    run_to(kv, request, 8)
    for position in range(9, 201):  # decode one token at a time
        run_to(kv, request, position)
        assert kv.blocks_held(request)["sliding"] <= 3
    assert kv.blocks_held(request)["full"] == 50


def test_allocation_fails_without_change_when_local_blocks_run_out():
    kv = manager(window=6, local_blocks=4)  # three usable local blocks
    request = make_request("a", list(range(3, 23)))
    assert not kv.allocate_slots(request, 20)  # five blocks at once do not fit
    assert kv.block_ids(request) == [] and kv.block_pool.num_free_blocks == 39
    run_to(kv, request, 12)
    assert kv.sliding.num_used_blocks == 2  # block 0 given back: position 12 sees 7..


def test_a_prefix_hit_needs_its_window_cached_locally():
    kv = manager(window=6)
    tokens = list(range(3, 23))
    first = make_request("a", tokens)
    run_to(kv, first, 20)
    second = make_request("b", tokens + [99])
    blocks, num_cached = kv.get_computed_blocks(second)
    assert num_cached == 20  # blocks 3, 4 (the window of position 20) are still held
    assert kv.allocate_slots(second, 1, blocks)
    assert kv.block_ids(second) == [1, 2, 3, 4, 5, 6]
    assert kv.local_block_ids(second) == [0, 0, 0, 4, 5, 6]  # freed ones wait in the queue


def test_a_hit_is_cut_where_the_local_window_was_evicted():
    kv = manager(window=6, local_blocks=4)
    tokens = list(range(3, 23))
    first = make_request("a", tokens)
    run_to(kv, first, 8)
    run_to(kv, first, 12)
    run_to(kv, first, 16)
    run_to(kv, first, 20)
    kv.free(first)
    other = make_request("x", list(range(100, 112)))
    run_to(kv, other, 12)  # takes local blocks, evicting the oldest cached ones
    second = make_request("b", tokens + [99])
    _, num_cached = kv.get_computed_blocks(second)
    hashes = kv._block_hashes(second)
    cached = [kv.sliding.block_pool.get_cached_block(h) is not None for h in hashes[:5]]
    first_needed = kv.sliding.first_visible(num_cached)
    assert all(cached[first_needed:num_cached // 4])
    assert num_cached < 20


@pytest.mark.parametrize("caching", [True, False])
def test_freeing_a_request_returns_every_local_block(caching):
    kv = manager(window=6, caching=caching)
    request = make_request("a", list(range(3, 40)))
    run_to(kv, request, 37)
    kv.free(request)
    assert kv.sliding.num_used_blocks == 0
    assert kv.block_pool.num_free_blocks == 39


def test_sliding_blocks_refuse_the_lanes_layout():
    with pytest.raises(ValueError, match="free placement"):
        KVCacheManager(40, 4, lane_blocks=8, sliding=SlidingBlocks(12, 4, 6))
