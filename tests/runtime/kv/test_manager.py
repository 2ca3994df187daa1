import numpy as np

from llmopt.runtime.kv.manager import KVCacheManager
from llmopt.runtime.request import Request
from llmopt.runtime.sampling_params import SamplingParams


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams())


def compute(manager: KVCacheManager, req: Request, num_tokens: int) -> None:
    """What the scheduler + a step do: allocate, then mark tokens computed."""
    assert manager.allocate_slots(req, num_tokens)
    req.num_computed_tokens += num_tokens
    manager.cache_blocks(req)


def test_block_table_grows_by_whole_blocks_and_maps_slots():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    req = request("a", list(range(10, 16)))  # 6 tokens
    assert manager.allocate_slots(req, 6)
    assert manager.block_ids(req) == [1, 2]
    np.testing.assert_array_equal(manager.slot_mapping(req, 0, 6), [4, 5, 6, 7, 8, 9])
    req.num_computed_tokens = 6
    assert manager.allocate_slots(req, 2)  # positions 6, 7 still fit in block 2
    assert manager.block_ids(req) == [1, 2]
    req.num_computed_tokens = 8
    assert manager.allocate_slots(req, 1)
    assert manager.block_ids(req) == [1, 2, 3]
    np.testing.assert_array_equal(manager.slot_mapping(req, 8, 1), [12])


def test_allocate_slots_says_no_when_blocks_run_out():
    manager = KVCacheManager(num_blocks=3, block_size=4)  # 2 usable blocks
    req = request("a", list(range(9)))
    assert not manager.allocate_slots(req, 9)
    assert manager.block_ids(req) == [] and manager.block_pool.num_free_blocks == 2
    assert manager.allocate_slots(req, 8)


def test_free_releases_the_table_tail_first():
    manager = KVCacheManager(num_blocks=5, block_size=2)
    req = request("a", list(range(6)))
    manager.allocate_slots(req, 6)
    manager.free(req)
    assert list(manager.block_pool.free_queue) == [4, 3, 2, 1]
    assert manager.block_ids(req) == []


def test_prefix_hit_shares_full_computed_blocks():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    a = request("a", list(range(10)))
    compute(manager, a, 10)
    assert manager.block_ids(a) == [1, 2, 3]
    assert manager.num_cached_blocks["a"] == 2  # the third block is not full

    b = request("b", [*range(8), 99, 98, 97])
    blocks, num_tokens = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [1, 2] and num_tokens == 8
    b.num_computed_tokens = 0
    assert manager.allocate_slots(b, 11 - 8, blocks)
    assert manager.block_ids(b) == [1, 2, 4]
    assert [manager.block_pool.blocks[i].ref_count for i in (1, 2, 3, 4)] == [2, 2, 1, 1]


def test_prefix_hit_never_covers_the_last_token():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    a = request("a", list(range(8)))
    compute(manager, a, 8)
    same = request("b", list(range(8)))
    blocks, num_tokens = manager.get_computed_blocks(same)
    assert [blk.block_id for blk in blocks] == [1] and num_tokens == 4


def test_blocks_are_cached_only_once_computed():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    a = request("a", list(range(8)))
    assert manager.allocate_slots(a, 8)  # scheduled but not yet computed
    assert manager.get_computed_blocks(request("b", list(range(9))))[1] == 0
    a.num_computed_tokens = 5
    manager.cache_blocks(a)
    assert manager.get_computed_blocks(request("c", list(range(9))))[1] == 4


def test_freed_prefix_is_reused_and_a_free_hit_counts_against_free_blocks():
    manager = KVCacheManager(num_blocks=4, block_size=2)  # 3 usable blocks
    a = request("a", [1, 2, 3, 4, 5])
    compute(manager, a, 5)
    manager.free(a)
    assert list(manager.block_pool.free_queue) == [3, 2, 1]

    b = request("b", [1, 2, 3, 4, 9, 9])
    blocks, num_tokens = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in blocks] == [1, 2] and num_tokens == 4
    # Needs 1 new block + the 2 hits leave the free queue: 3 <= 3 free.
    assert manager.allocate_slots(b, 2, blocks)
    assert manager.block_ids(b) == [1, 2, 3]
    assert manager.block_pool.num_free_blocks == 0


def test_prefix_caching_can_be_disabled():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    a = request("a", list(range(9)))
    compute(manager, a, 9)
    assert manager.get_computed_blocks(request("b", list(range(9)))) == ([], 0)


def test_a_block_hits_only_after_the_same_prefix():
    # B's second block has the same tokens as C's, but C computed it after other tokens:
    # its keys and values belong to a different context, so the chain must stop at one.
    manager = KVCacheManager(num_blocks=16, block_size=2)
    p, q, r, s = [1, 2], [3, 4], [5, 6], [7, 8]
    compute(manager, request("a", [*p, *q, 9]), 5)
    compute(manager, request("c", [*r, *s, 9]), 5)
    blocks, num_tokens = manager.get_computed_blocks(request("b", [*p, *s, 9]))
    assert [blk.block_id for blk in blocks] == [1] and num_tokens == 2


# The lanes layout: a lane per request, tables in lane order, prefix hits in place or copied.
def manager_with_copies(num_lanes: int = 3) -> tuple[KVCacheManager, list]:
    manager = KVCacheManager(num_blocks=1 + 4 * num_lanes, block_size=4, lane_blocks=4)
    copies: list[tuple[int, int]] = []
    manager.copy_listeners.append(lambda src, dst: copies.append((src, dst)))
    return manager, copies


def admit(manager: KVCacheManager, req) -> bool:
    hits, cached = manager.get_computed_blocks(req)
    if not manager.allocate_slots(req, req.num_tokens - cached, hits):
        return False
    req.num_computed_tokens = cached
    return True


def test_a_request_runs_through_its_lane_in_order():
    manager, _ = manager_with_copies()
    a, b = request("a", list(range(10, 16))), request("b", list(range(30, 35)))
    assert admit(manager, a) and admit(manager, b)
    assert manager.block_ids(a) == [1, 2] and manager.block_ids(b) == [5, 6]
    compute(manager, a, 6)
    assert manager.allocate_slots(a, 3)  # grows within its lane
    assert manager.block_ids(a) == [1, 2, 3]
    assert not manager.allocate_slots(a, 11)  # 17 tokens: past the lane's 16


def test_a_prefix_held_by_a_running_lane_is_copied_and_a_free_lane_is_reused_in_place():
    manager, copies = manager_with_copies()
    prefix = list(range(100, 108))  # two full blocks
    first = request("first", prefix + [1, 2, 3])
    assert admit(manager, first)
    compute(manager, first, first.num_tokens)
    second = request("second", prefix + [7, 8])
    assert admit(manager, second) and second.num_computed_tokens == 8
    assert copies == [(1, 5), (2, 6)]  # lane 0's blocks into lane 1's
    manager.free(first)
    copies.clear()
    third = request("third", prefix + [9])
    assert admit(manager, third) and third.num_computed_tokens == 8
    assert manager.block_ids(third)[:2] == [1, 2] and copies == []  # lane 0, in place


def test_requests_wait_when_every_lane_is_taken():
    manager, _ = manager_with_copies(num_lanes=1)
    assert admit(manager, request("a", [5, 6, 7]))
    assert not admit(manager, request("b", [8, 9]))


def test_a_new_request_fills_the_lowest_free_lane_so_running_lanes_stay_packed():
    manager, _ = manager_with_copies(num_lanes=4)
    reqs = [request(name, [10 * i + t for t in range(5)]) for i, name in enumerate("abcd")]
    for req in reqs:
        assert admit(manager, req)
    lanes = {req.request_id: manager.lanes[req.request_id] for req in reqs}
    assert sorted(lanes.values()) == [0, 1, 2, 3]
    for req in reqs[:2]:  # both lanes cache a full block, lane 0 is freed last
        compute(manager, req, req.num_tokens)
    manager.free(reqs[1])
    manager.free(reqs[0])
    newcomer = request("e", [77, 78, 79])
    assert admit(manager, newcomer)
    assert manager.lanes["e"] == min(lanes["a"], lanes["b"])


# A trailing graph: its pool fills behind the target's over the same tables.
def test_a_hit_gives_a_trailing_graph_the_blocks_it_holds_in_full_until_they_are_reused():
    manager = KVCacheManager(num_blocks=5, block_size=4)
    trailing = manager.trail()
    a = request("a", list(range(10)))
    assert manager.allocate_slots(a, 10) and trailing.num_computed(a) == 0
    trailing.set_computed(a, 7)  # one full block of its own, then part of the next
    a.num_computed_tokens = 10
    manager.cache_blocks(a)
    assert manager.num_cached_blocks["a"] == 2 and trailing.full_blocks == {1}
    manager.free(a)
    b = request("b", [*range(8), 99])
    hits, cached = manager.get_computed_blocks(b)
    assert cached == 8 and manager.allocate_slots(b, 1, hits)
    b.num_computed_tokens = cached
    assert trailing.num_computed(b) == 4  # the target's hit is two blocks, its own one
    trailing.set_computed(b, 9)
    manager.cache_blocks(b)  # nothing computed past the target's 8 tokens stays its own
    assert trailing.num_computed(b) == 8
    manager.free(b)
    assert manager.allocate_slots(request("c", list(range(50, 66))), 16)  # reuses every block
    assert trailing.full_blocks == set()
