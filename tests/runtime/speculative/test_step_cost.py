from __future__ import annotations

import pytest
from runtime_fakes import fake_logits, reference_greedy
from test_speculative_engine import GREEDY, make_spec_engine, prompts, run_checked

from llmopt.runtime.request import Request
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.speculative.policy import SpeculationPolicy
from llmopt.runtime.speculative.step_cost import StepCostModel

VERIFY_COST = [1.0, 1.2, 1.3, 1.4, 1.5]
# A machine like the lanes executor measured: widening a 16-row call is dear.
MEASURED = {"batch_sizes": [1, 4, 16], "verify_step_ms": {
    "1": [10.0, 15.0, 40.0], "2": [12.0, 21.0, 60.0], "3": [13.0, 24.0, 80.0],
    "5": [15.0, 37.0, 105.0]}}


def test_without_a_table_the_batch_one_costs_apply():
    model = StepCostModel.from_verify_cost(VERIFY_COST)
    for k, cost in enumerate(VERIFY_COST):
        assert model.relative([k + 1], [1]) == pytest.approx(cost)


def test_one_wide_row_costs_what_the_padded_call_costs():
    model = StepCostModel.from_measured(MEASURED, VERIFY_COST)
    wide = model.call_cost(4, 5) / model.call_cost(4, 1)
    assert wide == pytest.approx(37 / 15, rel=0.1)  # the table, smoothed
    assert model.relative([5, 1, 1, 1], [1, 1, 1, 1]) == pytest.approx(wide)
    assert model.relative([5, 5, 5, 5], [1, 1, 1, 1]) == pytest.approx(wide)
    assert model.relative([3], [1]) == pytest.approx(1.3, rel=0.05)
    assert model.relative([2, 1], [1, 1]) == pytest.approx(model.call_cost(2, 2)
                                                           / model.call_cost(2, 1))


def test_rows_the_executor_would_not_pad_cost_a_call_of_their_own():
    model = StepCostModel.from_measured(MEASURED, VERIFY_COST)
    lens = [9] + [1] * 15  # padding_groups: a group of 5 padded to 9, one of 11 rows
    expected = model.call_cost(5, 9) + model.call_cost(11, 1)
    assert model.step_cost(lens) == pytest.approx(expected)


def test_a_noisy_table_never_makes_a_wider_step_cheaper():
    noisy = {"batch_sizes": [1], "verify_step_ms": {"1": [10.0], "2": [9.0], "3": [12.0]}}
    model = StepCostModel.from_measured(noisy, VERIFY_COST)
    assert model.call_cost(1, 2) >= model.call_cost(1, 1)


def test_one_lucky_entry_of_the_table_does_not_make_drafts_free():
    # Measured on SmolLM2 under load: a 2-token step at batch 4 timed as cheap as 1 token.
    lucky = {"batch_sizes": [4], "verify_step_ms": {
        "1": [59.9], "2": [60.3], "3": [89.8], "5": [87.4], "9": [121.5]}}
    model = StepCostModel.from_measured(lucky, VERIFY_COST)
    assert model.relative([2, 1, 1, 1], [1, 1, 1, 1]) > 1.1
    assert model.relative([9, 1, 1, 1], [1, 1, 1, 1]) == pytest.approx(121.5 / 59.9, rel=0.1)


def decoding(n: int) -> list[Request]:
    return [Request(str(i), [1, 2, 3], SamplingParams()) for i in range(n)]


def test_the_step_cap_keeps_drafts_that_pay_for_the_step():
    policy = SpeculationPolicy(4, VERIFY_COST, 0.0, prior_alpha=0.8,
                               step_model=StepCostModel.from_measured(MEASURED, VERIFY_COST))
    assert policy.cap([(r, "ngram", 4) for r in decoding(1)]) == 4  # batch 1: cheap
    # Batch 4, everyone drafting good tokens: widening pays.
    assert policy.cap([(r, "ngram", 4) for r in decoding(4)]) > 0


def test_one_sequence_does_not_widen_a_batch_for_its_own_drafts():
    policy = SpeculationPolicy(4, VERIFY_COST, 0.0, prior_alpha=0.8,
                               step_model=StepCostModel.from_measured(MEASURED, VERIFY_COST))
    one = decoding(1)
    # Alone its 4 drafts pay; beside 15 plain decodes they widen a dear 16-row step.
    assert policy.num_drafts(one[0]) == 4
    assert policy.cap([(one[0], "ngram", 4)], [1] * 15) == 0
    assert policy.cap([(one[0], "ngram", 4)], [1] * 3) < 4


def test_a_priced_out_batch_gives_the_plain_greedy_output():
    batch = prompts(8, seed=5)
    engine = make_spec_engine(fake_logits, gamma=4)  # a perfect draft
    dear = {"batch_sizes": [1, 8], "verify_step_ms": {  # widening 8 rows: 6x dearer
        "1": [10.0, 10.0], "2": [11.0, 60.0], "5": [13.0, 80.0]}}
    steps = StepCostModel.from_measured(dear, VERIFY_COST)
    engine.speculator.policy = SpeculationPolicy(4, VERIFY_COST, 0.0, 0.9, step_model=steps)
    outputs = run_checked(engine, batch, GREEDY)
    for prompt, out in zip(batch, outputs, strict=True):
        assert out.token_ids == reference_greedy(prompt, GREEDY.max_tokens)
    # Speculation only ran while few sequences were left decoding (the prefills are done
    # one by one within the token budget, and requests finish together).
    assert sum(o.metrics.speculation.num_spec_steps for o in outputs) < sum(
        o.metrics.speculation.num_decode_steps for o in outputs) / 2
