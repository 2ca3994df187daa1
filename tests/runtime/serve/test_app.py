"""The server on loopback, driven by the official `openai` client, over the toy artifact."""

from __future__ import annotations

import asyncio

import httpx2 as httpx
import openai
import pytest
from live_server import MODEL, live_server, metric, wait_for
from toy_artifact import build_artifact, reference_greedy

from llmopt.runtime import LLM, SamplingParams

GREEDY = {"temperature": 0, "max_tokens": 12}
MESSAGES = [[{"role": "user", "content": f"w{a} w{b}"}] for a, b in
            [(5, 6), (7, 9), (11, 3), (40, 41), (60, 8), (21, 33), (4, 4), (50, 12)]]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return build_artifact(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def offline(artifact) -> LLM:
    return LLM(artifact, num_threads=1)


@pytest.fixture(scope="module")
def server(artifact):
    with live_server(artifact) as (base, srv):
        yield base, srv


def offline_chat(offline: LLM, messages: list[dict], max_tokens: int = 12):
    prompt = offline.tokenizer.encode_chat(messages)
    return offline.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0]


def test_plain_and_streamed_chat_equal_offline_greedy(client, offline):
    expected = offline_chat(offline, MESSAGES[0])
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES[0], **GREEDY)
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES[0], stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_completions_with_token_prompt_equal_reference(client):
    prompt = [0, 7, 8, 9]
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].text.split() == [f"w{t}" for t in reference_greedy(
        prompt, 10, eos=None) if t > 2]
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 10


def test_concurrent_requests_equal_their_offline_outputs(server, offline):
    async def one(client: openai.AsyncOpenAI, messages: list[dict], stream: bool) -> str:
        if not stream:
            reply = await client.chat.completions.create(model=MODEL, messages=messages,
                                                         **GREEDY)
            return reply.choices[0].message.content
        parts = []
        async for chunk in await client.chat.completions.create(
                model=MODEL, messages=messages, stream=True, **GREEDY):
            parts.append(chunk.choices[0].delta.content or "")
        return "".join(parts)

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server[0]}/v1", api_key="none") as client:
            return await asyncio.gather(*(one(client, m, i % 2 == 0)
                                          for i, m in enumerate(MESSAGES * 3)))

    got = asyncio.run(all_of_them())
    assert got == [offline_chat(offline, m).text for m in MESSAGES * 3]


def test_sampling_fields_seed_n_stop_and_logprobs(client, offline):
    kwargs = dict(model=MODEL, messages=MESSAGES[1], max_tokens=10, temperature=1.5,
                  top_p=0.9, seed=7, n=2, extra_body={"top_k": 20, "min_p": 0.01,
                                                      "repetition_penalty": 1.1})
    first, again = (client.chat.completions.create(**kwargs) for _ in range(2))
    assert [c.message.content for c in first.choices] == [
        c.message.content for c in again.choices]  # seeded: reproducible
    assert len(first.choices) == 2 and first.usage.completion_tokens == sum(
        len(offline.tokenizer.encode(c.message.content, add_bos=False)) for c in first.choices)
    expected = offline_chat(offline, MESSAGES[2])
    stop = expected.text.split()[2]
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES[2], stop=[stop],
                                           logprobs=True, top_logprobs=3, **GREEDY)
    choice = reply.choices[0]
    assert choice.message.content == expected.text[: expected.text.index(stop)]
    assert choice.finish_reason == "stop"
    for entry in choice.logprobs.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy took the best token


def test_streamed_completion_logprobs_follow_the_text(client):
    chunks = list(client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=6,
                                            temperature=0, logprobs=1, stream=True))
    text, offsets, tokens = "", [], []
    for chunk in chunks:
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs:
            offsets += choice.logprobs.text_offset
            tokens += choice.logprobs.tokens
    assert offsets == sorted(offsets) and offsets[0] == 0 and len(tokens) == 6
    assert all(text.find(t.strip(), o) >= o for t, o in zip(tokens, offsets, strict=True))


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"messages": [{"role": "user", "content": " ".join(["w5"] * 80)}]}, "messages"),
    ({"n": 0}, "n"), ({"top_logprobs": 2}, None),
])
def test_invalid_values_are_400_in_openai_error_json(client, fields, param):
    body = {"model": MODEL, "messages": MESSAGES[0], **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    assert info.value.status_code == 400
    error = info.value.body
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param


def test_unknown_model_is_404_and_garbage_is_400(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES[0])
    assert "gpt-4" in info.value.body["message"]
    bad_tokens = httpx.post(f"{server[0]}/v1/completions", json={"model": MODEL,
                                                                  "prompt": [3, 64]})
    assert bad_tokens.status_code == 400 and "outside the vocabulary" in bad_tokens.text
    for body in (b"{not json", b'{"model": "toy"}', b'{"model": "toy", "messages": 3}'):
        response = httpx.post(f"{server[0]}/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and "error" in response.json()
    assert httpx.get(f"{server[0]}/health").status_code == 200  # still serving


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=4, temperature=0)
    base = server[0]
    assert httpx.get(f"{base}/health").status_code == 200
    assert metric(base, "llmopt_generation_tokens_total") > 0
    assert metric(base, "llmopt_time_to_first_token_seconds_count") > 0
    text = httpx.get(f"{base}/metrics").text
    for name in ("llmopt_requests_total", "llmopt_prompt_tokens_total",
                 "llmopt_inter_token_latency_seconds_bucket", "llmopt_num_requests_running",
                 "llmopt_num_requests_waiting", "llmopt_kv_cache_usage_ratio",
                 "llmopt_prefix_cache_hit_tokens_total",
                 "llmopt_spec_decode_accepted_tokens_total"):
        assert name in text


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    base, srv = server
    aborted = metric(base, "llmopt_requests_total", outcome="abort")
    body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 60, "temperature": 0,
            "stream": True, "ignore_eos": True}
    srv.loop.engine.executor.execute = slow(srv.loop.engine.executor.execute)
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body) as response:
            for _ in zip(range(3), response.iter_lines(), strict=False):
                pass
        assert wait_for(lambda: metric(base, "llmopt_requests_total", outcome="abort")
                        == aborted + 1)
    finally:
        del srv.loop.engine.executor.execute  # back to the class's method
    assert wait_for(lambda: metric(base, "llmopt_kv_cache_used_blocks") == 0)
    assert metric(base, "llmopt_num_requests_running") == 0


def slow(execute):
    """A step that takes 20 ms, so a 60-token stream is still running when it is dropped."""
    import time

    def run(batch):
        time.sleep(0.02)
        return execute(batch)
    return run


def test_auth(artifact):
    with live_server(artifact, api_key="sekrit") as (base, _):
        wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            wrong.models.list()
        assert info.value.status_code == 401
        missing = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "w5"})
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="w5", max_tokens=2).choices


def test_full_waiting_queue_is_503_with_retry_after(artifact):
    with live_server(artifact, max_waiting=0, max_num_seqs=1) as (base, srv):
        srv.loop.engine.executor.execute = slow(srv.loop.engine.executor.execute)
        body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 60, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body) as first:
            lines = first.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)
            assert srv.in_flight == 1
            second = httpx.post(f"{base}/v1/completions", json={**body, "stream": False})
            assert second.status_code == 503 and second.headers["retry-after"]
            assert second.json()["error"]["type"] == "service_unavailable"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        assert wait_for(lambda: srv.in_flight == 0)
        assert client.completions.create(model=MODEL, prompt="w5", max_tokens=2).choices
