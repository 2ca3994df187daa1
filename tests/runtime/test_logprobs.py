"""Per-token logprobs of generated tokens (SamplingParams.logprobs), plain and speculative."""

from __future__ import annotations

import numpy as np
import pytest
from toy_artifact import add_draft, build_artifact, toy_logits

from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.sampler import log_softmax


@pytest.mark.parametrize("speculative", [False, True])
def test_logprobs_are_the_models_own_distribution(tmp_path, speculative):
    artifact = build_artifact(tmp_path)
    if speculative:
        add_draft(artifact, gamma=3)
    llm = LLM(artifact, num_threads=1)
    prompt = [0, 5, 9, 13]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    (out,) = llm.generate(prompt, params)
    assert len(out.logprobs) == len(out.token_ids) == 10
    tokens = list(prompt)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        expected = log_softmax(toy_logits(tokens))
        best = np.argsort(-expected, kind="stable")[:2]
        assert entry.token_id == token == best[0]
        assert entry.logprob == pytest.approx(expected[token], abs=1e-5)
        assert [t for t, _ in entry.top] == best.tolist()
        tokens.append(token)
    if speculative:
        assert out.metrics.speculation.num_accepted_tokens > 0  # the verify path ran


def test_no_logprobs_unless_asked(tmp_path):
    llm = LLM(build_artifact(tmp_path), num_threads=1)
    (out,) = llm.generate([0, 5], SamplingParams(temperature=0, max_tokens=3))
    assert out.logprobs is None
    with pytest.raises(ValueError, match="logprobs must be >= 0"):
        SamplingParams(logprobs=-1)
