"""LaneKVCacheManager: a lane per request, tables in lane order, prefix hits in place or copied."""

from test_manager import compute, request

from llmopt.runtime.kv.lane_manager import LaneKVCacheManager


def manager_with_copies(num_lanes: int = 3) -> tuple[LaneKVCacheManager, list]:
    manager = LaneKVCacheManager(num_blocks=1 + 4 * num_lanes, block_size=4, lane_blocks=4)
    copies: list[tuple[int, int]] = []
    manager.copy_listeners.append(lambda src, dst: copies.append((src, dst)))
    return manager, copies


def admit(manager: LaneKVCacheManager, req) -> bool:
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
