"""LLM over an artifact with a draft: real ONNX Runtime sessions for target and draft."""

from __future__ import annotations

import pytest
from toy_artifact import add_draft, build_artifact, reference_greedy

from llmopt.runtime import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[0, 5, 9, 13], [0, 7, 7, 7, 7, 2], [0, 3]]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return add_draft(build_artifact(tmp_path_factory.mktemp("toy-spec")), gamma=3, ngram=True)


def test_speculation_is_on_by_default_and_changes_no_greedy_output(artifact):
    llm = LLM(artifact, num_threads=1)
    outputs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.token_ids == reference_greedy(prompt, 12, eos=None)
    assert sum(o.metrics.speculation.num_spec_steps for o in outputs) > 0
    plain = LLM(artifact, num_threads=1, speculative=False).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in plain] == [o.token_ids for o in outputs]
    assert all(o.metrics.speculation.num_spec_steps == 0 for o in plain)


def test_a_perfect_draft_model_is_always_accepted(tmp_path):
    artifact = add_draft(build_artifact(tmp_path), gamma=3)
    llm = LLM(artifact, num_threads=1, num_speculative_tokens=4, adaptive_speculation=False)
    (out,) = llm.generate([PROMPTS[0]], GREEDY)
    spec = out.metrics.speculation
    assert spec.acceptance_rate == 1.0 and spec.tokens_per_step(12) >= 3


def test_speculation_without_a_draft_is_a_clear_error(tmp_path):
    plain = build_artifact(tmp_path / "plain")
    with pytest.raises(ValueError, match="compiled with a draft"):
        LLM(plain, num_speculative_tokens=2)


def test_drafts_picks_the_ngram_or_the_model_draft(artifact):
    for drafts in ("ngram", "model"):
        outputs = LLM(artifact, num_threads=1, drafts=drafts).generate(PROMPTS, GREEDY)
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            assert out.token_ids == reference_greedy(prompt, 12, eos=None)
    with pytest.raises(ValueError, match="drafts must be"):
        LLM(artifact, drafts="both")


def test_asking_for_a_draft_the_artifact_lacks_is_a_clear_error(tmp_path):
    ngram_only = add_draft(build_artifact(tmp_path), gamma=2, model=False, ngram=True)
    with pytest.raises(ValueError, match="no model draft"):
        LLM(ngram_only, drafts="model")
