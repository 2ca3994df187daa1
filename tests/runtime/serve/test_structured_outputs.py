"""Structured outputs over HTTP with the official `openai` client, on the tiny Qwen2
artifact: response_format (the `parse` pattern), vLLM's structured_outputs and guided_*
fields, streamed and whole; what cannot compile is a 400, and the server keeps serving."""

from __future__ import annotations

import dataclasses
import json
import re
from enum import Enum

import httpx2 as httpx
import jsonschema
import openai
import pytest
from live_server import MODEL, live_server
from pydantic import BaseModel, Field

from llmopt.runtime import LLM, SamplingParams
from llmopt.runtime.structured import StructuredOutputsParams

USER = [{"role": "user", "content": "Describe a pet."}]


class Kind(str, Enum):
    cat = "cat"
    dog = "dog"


class Owner(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)


class Pet(BaseModel):
    kind: Kind
    owner: Owner
    toys: list[Kind] = Field(max_length=2)


@pytest.fixture(scope="module")
def server(tool_artifact):
    with live_server(tool_artifact, speculative=False) as (base, srv):
        yield base, srv


def test_parse_returns_a_valid_pydantic_instance(client, server):
    reply = client.chat.completions.parse(model=MODEL, messages=USER, response_format=Pet,
                                          temperature=0, max_tokens=300)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)
    assert Pet.model_validate_json(choice.message.content) == choice.message.parsed
    # the same greedy answer the engine gives offline under the same schema
    llm = server[1].llm
    schema = openai.lib._parsing._completions.type_to_response_format_param(Pet)
    params = dataclasses.replace(  # the server's: the checkpoint's defaults underneath
        llm.default_params, max_tokens=300, temperature=0,
        structured_outputs=StructuredOutputsParams(json=schema["json_schema"]["schema"]))
    offline = llm.generate(llm.tokenizer.encode_chat(USER), params)[0]
    assert offline.text == choice.message.content


def test_streamed_structured_answer_equals_the_whole_one(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {
        "type": "integer", "minimum": 0, "maximum": 99}}, "required": ["ok", "n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    whole = client.chat.completions.create(model=MODEL, messages=USER, response_format=fmt,
                                           temperature=0, max_tokens=100)
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                                 response_format=fmt, temperature=0,
                                                 max_tokens=100))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_and_vllm_fields(client, server):
    obj = client.chat.completions.create(model=MODEL, messages=USER, temperature=0,
                                         max_tokens=400, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # a random model may nest until the limit: still an object's beginning
        assert obj.choices[0].message.content.startswith("{")
    regex = client.chat.completions.create(
        model=MODEL, messages=USER, temperature=0, max_tokens=30,
        extra_body={"structured_outputs": {"regex": r"[a-c]{3}-\d{2}"}})
    assert re.fullmatch(r"[a-c]{3}-\d{2}", regex.choices[0].message.content)
    choice = client.chat.completions.create(model=MODEL, messages=USER, temperature=0,
                                            max_tokens=10,
                                            extra_body={"guided_choice": ["left", "right"]})
    assert choice.choices[0].message.content in ("left", "right")
    completion = client.completions.create(
        model=MODEL, prompt="Count:", temperature=0, max_tokens=20,
        extra_body={"guided_grammar": 'root ::= "1" (", " [0-9])+ "."'})
    assert re.fullmatch(r"1(, [0-9])+\.", completion.choices[0].text)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format", "Invalid type: strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs json_schema.schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "regex"),
    ({"guided_json": "{not json"}, None, "not valid JSON"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", "undefined_rule"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, None,
     "at most one of"),
    ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos", "ignore_eos"),
])
def test_what_cannot_compile_is_a_400_and_the_server_keeps_serving(server, body, param,
                                                                   message):
    base = server[0]
    reply = httpx.post(f"{base}/v1/chat/completions", json={
        "model": MODEL, "messages": USER, "max_tokens": 5, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    assert httpx.get(f"{base}/health").status_code == 200
    ok = httpx.post(f"{base}/v1/chat/completions", json={
        "model": MODEL, "messages": USER, "max_tokens": 5, "guided_choice": ["fine"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"


def test_the_server_reports_a_tokenizer_the_grammar_engine_cannot_read(tmp_path):
    """The toy artifact's word-level tokenizer has no decoder llguidance can read."""
    from toy_artifact import build_artifact

    with live_server(build_artifact(tmp_path)) as (base, _):
        reply = httpx.post(f"{base}/v1/completions", json={
            "model": MODEL, "prompt": "w1", "max_tokens": 5, "guided_regex": "w2"})
        assert reply.status_code == 400
        assert "cannot read this tokenizer" in reply.json()["error"]["message"]


def test_offline_llm_takes_the_same_constraint(server):
    llm: LLM = server[1].llm
    out = llm.generate("Pick:", SamplingParams(max_tokens=10, temperature=0,
                                               structured_outputs=StructuredOutputsParams(
                                                   choice=["alpha", "beta"])))[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
