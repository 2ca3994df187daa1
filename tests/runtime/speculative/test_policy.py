from __future__ import annotations

import numpy as np
import pytest
from runtime_fakes import fake_logits, reference_greedy
from test_speculative_engine import GREEDY, make_spec_engine, prompts, run_checked

from llmopt.runtime.request import Request
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.speculative.cost_model import expected_tokens
from llmopt.runtime.speculative.policy import SpeculationPolicy


def request() -> Request:
    return Request("r", [1, 2, 3], SamplingParams())


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_cheap_verification_and_good_drafts_use_all_of_gamma():
    policy = SpeculationPolicy(4, [1.0, 1.05, 1.1, 1.15, 1.2], 0.05, prior_alpha=0.8)
    assert policy.num_drafts(request()) == 4


def test_drafts_that_do_not_pay_are_not_proposed():
    policy = SpeculationPolicy(4, [1.0, 1.5, 2.0, 2.5, 3.0], 0.2, prior_alpha=0.2)
    assert policy.num_drafts(request()) == 0


def test_rejections_shrink_the_drafts_and_plain_steps_let_them_come_back():
    policy = SpeculationPolicy(4, [1.0, 1.15, 1.3, 1.45, 1.6], 0.05, prior_alpha=0.7)
    r = request()
    assert policy.num_drafts(r, "model") > 0
    for _ in range(6):
        policy.observe(r, "model", policy.num_drafts(r, "model") or 1, 0)  # all rejected
    assert policy.num_drafts(r, "model") == 0
    steps = 0
    while policy.num_drafts(r, "model") == 0:
        policy.observe(r, "", 0, 0)  # plain steps: the evidence fades towards the prior
        steps += 1
    assert 1 <= steps <= 100


def test_each_draft_source_is_priced_on_its_own_record():
    policy = SpeculationPolicy(4, [1.0, 1.15, 1.3, 1.45, 1.6], 0.0, prior_alpha=0.5)
    r = request()
    for _ in range(5):
        policy.observe(r, "ngram1", 4, 0)  # short matches keep failing
        policy.observe(r, "ngram4", 4, 4)  # long ones keep being accepted
    assert policy.num_drafts(r, "ngram1") == 0
    assert policy.num_drafts(r, "ngram4") == 4
    assert policy.num_drafts(r) == 4  # the scheduler reserves for the best source


def test_a_new_source_starts_from_what_the_sequence_has_shown():
    policy = SpeculationPolicy(4, [1.0, 1.15, 1.3, 1.45, 1.6], 0.0, prior_alpha=0.5)
    fresh, failing = request(), request()
    for _ in range(5):
        policy.observe(failing, "ngram1", 4, 0)
    assert policy.alpha(failing, "ngram3") < 0.5 * policy.alpha(fresh, "ngram3")


def always_wrong(h: int) -> np.ndarray:
    return -fake_logits(h)  # the target's least likely token, every time


def test_the_engine_backs_off_a_useless_draft_and_keeps_the_output():
    batch = prompts(2, seed=21)
    engine = make_spec_engine(always_wrong, gamma=3)
    engine.speculator.policy = SpeculationPolicy(3, [1.0, 1.2, 1.4, 1.6], 0.1, 0.6)
    outputs = run_checked(engine, batch, GREEDY)
    for prompt, out in zip(batch, outputs, strict=True):
        assert out.token_ids == reference_greedy(prompt, GREEDY.max_tokens)
        spec = out.metrics.speculation
        assert spec.num_accepted_tokens == 0
        assert spec.num_spec_steps < spec.num_decode_steps / 2


def test_a_new_sequence_starts_from_what_the_engine_has_seen():
    policy = SpeculationPolicy(4, [1.0, 1.15, 1.3, 1.45, 1.6], 0.0, prior_alpha=0.8)
    for i in range(20):  # earlier sequences' drafts mostly failed
        policy.observe(Request(str(i), [1, 2, 3], SamplingParams()), "ngram2", 2, 0)
    fresh = request()
    assert policy.alpha(fresh, "ngram2") < 0.4
    assert policy.alpha(fresh, "ngram5") < 0.8  # an unseen source: the engine's average


def test_a_step_whose_drafts_barely_pay_stays_plain():
    policy = SpeculationPolicy(1, [1.0, 1.3], 0.0, prior_alpha=0.32)  # 1.32 / 1.3: +1.5 %
    assert policy.num_drafts(request()) == 1
    assert policy.cap([(request(), "ngram1", 1)]) == 0
    generous = SpeculationPolicy(1, [1.0, 1.3], 0.0, prior_alpha=0.32, min_gain=1.0)
    assert generous.cap([(request(), "ngram1", 1)]) == 1
