import pytest

from llmopt.runtime.kv.manager import KVCacheManager
from llmopt.runtime.request import Request, RequestStatus
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.scheduler import ScheduledRequest, Scheduler, SchedulerConfig


def make_scheduler(
    *, num_blocks=32, block_size=4, max_num_seqs=8, budget=16, max_context=64, eos=()
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, budget, max_context)
    manager = KVCacheManager(num_blocks, block_size)
    return Scheduler(config, manager, eos_token_ids=eos)


def add(scheduler: Scheduler, request_id: str, prompt_len: int, **params) -> Request:
    # Distinct tokens per request: no accidental prefix-cache hits between them.
    req = Request(request_id, [ord(request_id[0])] * prompt_len, SamplingParams(**params))
    scheduler.add_request(req)
    return req


def plan(scheduled: list[ScheduledRequest]) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_tokens) for s in scheduled]


def finish_step(scheduler: Scheduler, scheduled: list[ScheduledRequest], token: int = 5):
    """Pretend the step ran: every request that caught up samples `token`."""
    sampled = {
        s.request.request_id: [token]
        for s in scheduled
        if s.request.num_computed_tokens + s.num_tokens == s.request.num_tokens
    }
    return scheduler.update_from_output(scheduled, sampled)


def test_prefill_is_chunked_to_the_token_budget_and_decodes_go_first():
    scheduler = make_scheduler(budget=8)
    a = add(scheduler, "a", 10, max_tokens=3)
    b = add(scheduler, "b", 5, max_tokens=3)

    step = scheduler.schedule()
    assert plan(step) == [("a", 8)]
    finish_step(scheduler, step)
    assert a.num_computed_tokens == 8 and a.output_token_ids == []

    step = scheduler.schedule()
    assert plan(step) == [("a", 2), ("b", 5)]
    finish_step(scheduler, step)
    assert a.output_token_ids == [5] and b.output_token_ids == [5]

    step = scheduler.schedule()  # both decode: one token each
    assert plan(step) == [("a", 1), ("b", 1)]


def test_max_num_seqs_bounds_the_running_set():
    scheduler = make_scheduler(max_num_seqs=2, budget=64)
    for name in "abc":
        add(scheduler, name, 3, max_tokens=1)
    step = scheduler.schedule()
    assert plan(step) == [("a", 3), ("b", 3)]
    finish = finish_step(scheduler, step)
    assert [r.finish_reason for r in finish] == ["length", "length"]
    assert plan(scheduler.schedule()) == [("c", 3)]


def test_stop_reasons():
    scheduler = make_scheduler(eos=(5,), max_context=12, budget=64)
    eos = add(scheduler, "eos", 3, max_tokens=10)
    ignore = add(scheduler, "ignore", 3, max_tokens=2, ignore_eos=True)
    stop_id = add(scheduler, "stop_id", 3, max_tokens=10, stop_token_ids=[6], ignore_eos=True)
    context = add(scheduler, "context", 10, max_tokens=10, ignore_eos=True)

    step = scheduler.schedule()
    finish_step(scheduler, step, token=5)
    assert (eos.finish_reason, eos.output_token_ids) == ("stop", [5])
    assert ignore.finish_reason is None
    step = scheduler.schedule()
    finish_step(scheduler, step, token=6)
    assert (ignore.finish_reason, ignore.output_token_ids) == ("length", [5, 6])
    assert (stop_id.finish_reason, stop_id.output_token_ids) == ("stop", [5, 6])
    assert (context.finish_reason, context.num_tokens) == ("length", 12)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 31


def test_preemption_takes_the_latest_admitted_and_recomputes_exactly():
    # 6 usable blocks of 4 tokens; three requests of 7 tokens take 2 blocks each.
    scheduler = make_scheduler(num_blocks=7, budget=64, max_context=24)
    a, b, c = (add(scheduler, name, 7, max_tokens=8) for name in "abc")
    step = scheduler.schedule()
    assert plan(step) == [("a", 7), ("b", 7), ("c", 7)]
    finish_step(scheduler, step)  # each now has 8 known tokens, 7 computed

    step = scheduler.schedule()  # every decode fits in its second block
    finish_step(scheduler, step)
    assert scheduler.num_preemptions == 0

    # Now each needs a third block and none is free: c (admitted last) is preempted,
    # its blocks let a and b decode.
    step = scheduler.schedule()
    assert plan(step) == [("a", 1), ("b", 1)]
    assert scheduler.num_preemptions == 1
    assert c.status is RequestStatus.WAITING and scheduler.waiting[0] is c
    assert c.num_computed_tokens == 0 and c.output_token_ids == [5, 5]
    assert c.num_tokens == 9  # its outputs stay known tokens, recomputed on readmission
    assert scheduler.kv_cache_manager.block_ids(c) == []
    finish_step(scheduler, step)


def test_nothing_is_admitted_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=4, block_size=2, budget=64, max_context=6)
    a = add(scheduler, "a", 4, max_tokens=4)
    b = add(scheduler, "b", 1, max_tokens=4)
    finish_step(scheduler, scheduler.schedule())  # a: 2 blocks, b: 1 block
    step = scheduler.schedule()  # a needs a third block: b is preempted
    assert plan(step) == [("a", 1)] and b.num_preemptions == 1
    assert list(scheduler.waiting) == [b]
    assert a.num_computed_tokens == 4


def test_prompt_too_long_for_the_context_is_rejected_at_add_time():
    scheduler = make_scheduler(max_context=16)
    with pytest.raises(ValueError, match="prompt has 16 tokens but the max context is 16"):
        add(scheduler, "a", 16)
    with pytest.raises(ValueError, match="empty"):
        add(scheduler, "b", 0)
    add(scheduler, "c", 15)
    scored = Request("d", [1] * 16, SamplingParams(), score_only=True)
    scheduler.add_request(scored)  # scoring needs no room for an output token
    assert len(scheduler.waiting) == 2


def test_finish_request_frees_a_waiting_or_running_request():
    scheduler = make_scheduler()
    a = add(scheduler, "a", 5)
    b = add(scheduler, "b", 5)
    scheduler.schedule()
    scheduler.finish_request(a, "abort")
    assert a.is_finished and scheduler.kv_cache_manager.block_ids(a) == []
    scheduler.finish_request(b, "abort")
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 31
