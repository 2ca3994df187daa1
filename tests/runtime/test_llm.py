import json

import numpy as np
import pytest
from toy_artifact import build_artifact, reference_greedy, toy_logits

from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.artifact import ArtifactError
from llmopt.runtime.sampler import log_softmax

GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return build_artifact(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def llm(artifact) -> LLM:
    return LLM(artifact, num_threads=1)


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def test_generate_text_and_token_prompts(llm):
    prompt_ids = [0, 5, 9, 13]  # BOS + "w5 w9 w13"
    text_out, ids_out = llm.generate([words(prompt_ids[1:]), prompt_ids], GREEDY)
    expected = reference_greedy(prompt_ids, 10)
    assert text_out.prompt_token_ids == prompt_ids and text_out.prompt == "w5 w9 w13"
    assert text_out.token_ids == ids_out.token_ids == expected
    assert text_out.text == llm.tokenizer.decode(expected)
    assert text_out.finish_reason == ("stop" if expected[-1] == 1 else "length")


def test_generate_a_batch_matches_one_at_a_time(llm):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 64, int(n)).tolist() for n in rng.integers(1, 40, 12)]
    params = [
        SamplingParams(temperature=0, max_tokens=12)
        if i % 2
        else SamplingParams(temperature=1.5, seed=i, max_tokens=12)
        for i in range(len(prompts))
    ]
    together = llm.generate(prompts, params)
    alone = [llm.generate(p, sp)[0] for p, sp in zip(prompts, params, strict=True)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    for i in range(1, len(prompts), 2):
        assert together[i].token_ids == reference_greedy(prompts[i], 12)


def test_default_params_come_from_the_manifest(llm):
    (out,) = llm.generate([3, 4, 5])
    assert out.token_ids == reference_greedy([3, 4, 5], 8)  # do_sample False, max_new_tokens 8


def test_stream_yields_deltas_that_add_up_to_the_text(llm):
    prompt = [0, 7, 8]
    deltas = list(llm.stream(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
    expected = reference_greedy(prompt, 10, eos=None)
    assert "".join(deltas) == llm.tokenizer.decode(expected)
    assert len(deltas) > 1
    assert not llm.engine.has_unfinished_requests()


def test_abandoned_stream_frees_its_request(llm):
    stream = llm.stream([0, 7, 8], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished_requests()


def test_chat_uses_the_template(llm):
    (out,) = llm.generate("w5 w6", SamplingParams(temperature=0, max_tokens=4), chat=True)
    user, assistant = (
        llm.tokenizer.encode("user", add_bos=False),
        llm.tokenizer.encode("assistant", add_bos=False),
    )
    assert out.prompt_token_ids == [0, *user, 5, 6, *assistant]  # one BOS, from the template


def test_score_gives_next_token_logprobs(llm):
    tokens = list(np.random.default_rng(1).integers(3, 64, 40))  # 3 chunks of 16
    logprobs = llm.score(tokens)
    expected = [log_softmax(toy_logits(tokens[: t + 1]))[tokens[t + 1]] for t in range(39)]
    assert logprobs.shape == (39,) and logprobs.dtype == np.float32
    np.testing.assert_allclose(logprobs, expected, rtol=1e-5)


def test_too_long_prompt_is_rejected_before_anything_is_queued(llm):
    with pytest.raises(ValueError, match="prompt has 64 tokens but the max context is 64"):
        llm.generate([[3, 4], [5] * 64])
    assert not llm.engine.has_unfinished_requests()


def test_token_ids_outside_the_vocabulary_are_rejected(llm):
    with pytest.raises(ValueError, match=r"token ids \[64, -1\] are outside the vocabulary"):
        llm.generate([3, 64, -1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.score([3, 99])


def test_pool_too_small_is_rejected(artifact):
    with pytest.raises(ValueError, match="the KV pool has 1 blocks"):
        LLM(artifact, num_blocks=1)


def test_corrupt_or_missing_files_are_named(tmp_path):
    path = build_artifact(tmp_path / "a")
    with open(path / "model.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ArtifactError, match="corrupt artifact .*: sha256 of model.onnx is"):
        LLM(path)

    path = build_artifact(tmp_path / "b")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="corrupt artifact .*: tokenizer.json is missing"):
        LLM(path)


def test_format_version_mismatch_names_both_versions(tmp_path):
    path = build_artifact(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        ArtifactError, match="format_version 99 but this runtime reads format_version 1"
    ):
        LLM(path)
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        LLM(tmp_path / "nowhere")


def test_without_a_generation_length_generate_stops_where_the_cli_does(tmp_path):
    """The checkpoint's generation config names no max_new_tokens: 128, as `llmopt generate`."""
    from llmopt.runtime.sampling_params import DEFAULT_MAX_TOKENS

    directory = build_artifact(tmp_path / "toy")
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["generation"] = {"do_sample": False}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    llm = LLM(directory)
    assert llm.default_params.max_tokens == DEFAULT_MAX_TOKENS == 128
