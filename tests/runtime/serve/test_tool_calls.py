"""Tool calls over HTTP with the official `openai` client, on the tiny Qwen2 artifact with
Qwen2.5's template: a forced call, the tool's answer, the model's reply; streamed and
whole; bad tools are 400s."""

from __future__ import annotations

import json

import httpx2 as httpx
import jsonschema
import openai
import pytest
from live_server import MODEL, live_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
USER = {"role": "user", "content": "What is the weather in Paris?"}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tool_artifact):
    with live_server(tool_artifact, speculative=False) as (base, srv):
        yield base, srv


def check_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def streamed(client: openai.OpenAI, **request) -> tuple[str, list[dict], str, list]:
    """(content, calls assembled from the deltas, finish reason, the tool-call deltas)."""
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **request))
    content, calls, deltas = "", [], []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            deltas.append(call)
            if call.id is not None:
                assert call.index == len(calls)
                calls.append({"id": call.id, "name": call.function.name, "arguments": ""})
            calls[call.index]["arguments"] += call.function.arguments or ""
    return content, calls, chunks[-1].choices[0].finish_reason, deltas


def test_tool_round_trip(client):
    """call (forced by name) -> the tool's result -> the model's answer, whole."""
    first = client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS,
                                           tool_choice=NAMED, temperature=0, max_tokens=200)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    check_call(call, WEATHER)
    messages = [USER, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                            tool_choice="none", temperature=0, max_tokens=8)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content and answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and result


def test_streamed_calls_are_the_whole_calls_in_openai_deltas(client):
    request = {"messages": [USER], "tools": TOOLS, "tool_choice": "required",
               "parallel_tool_calls": False, "temperature": 0, "max_tokens": 200}
    whole = client.chat.completions.create(model=MODEL, **request).choices[0]
    content, calls, finish, deltas = streamed(client, **request)
    assert content == "" and finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert deltas[0].function.arguments == "" and deltas[0].type == "function"
    assert len(deltas) > 2  # the arguments arrive in pieces
    tool = next(t for t in TOOLS if t["function"]["name"] == calls[0]["name"])
    jsonschema.validate(json.loads(calls[0]["arguments"]), tool["function"]["parameters"])


def test_streamed_round_trip_with_a_named_tool(client):
    content, calls, finish, _ = streamed(client, messages=[USER], tools=TOOLS,
                                         tool_choice={"type": "function",
                                                      "function": {"name": "add"}},
                                         temperature=0, max_tokens=200)
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["add"]
    call = {"id": calls[0]["id"], "type": "function",
            "function": {"name": "add", "arguments": calls[0]["arguments"]}}
    messages = [USER, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": calls[0]["id"], "content": "7"}]
    text, more, finish, _ = streamed(client, messages=messages, tools=TOOLS, tool_choice="none",
                                     temperature=0, max_tokens=6)
    assert text and not more and finish == "length"


def test_auto_parses_what_the_model_writes(server, client):
    """With tool_choice auto the reply is read for calls: here the model's (random) text
    is content; a reply that is a call is checked in test_reply.py."""
    reply = client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS,
                                           temperature=0, max_tokens=10).choices[0]
    assert reply.message.tool_calls is None and reply.finish_reason == "length"
    assert reply.message.content


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "'get_time', which is not among the tools ['get_weather', 'add']"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integr"}}}}}]},
     "tools[f].parameters", "Invalid type: integr"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "must be unique"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name",
     "pattern"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with response_format"),
])
def test_bad_tools_are_400s_and_the_server_keeps_serving(server, body, param, message):
    base = server[0]
    request = {"model": MODEL, "messages": [USER], "tools": TOOLS, "max_tokens": 5, **body}
    reply = httpx.post(f"{base}/v1/chat/completions", json=request)
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == param
    ok = httpx.post(f"{base}/v1/chat/completions", json={
        "model": MODEL, "messages": [USER], "tools": TOOLS, "tool_choice": NAMED,
        "max_tokens": 100, "temperature": 0})
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == \
        "get_weather"


def test_a_template_without_a_tool_format_is_a_400(tmp_path):
    """The toy artifact's template renders no tools: tools are refused, naming the formats
    that are read; tool_choice none still answers."""
    from toy_artifact import build_artifact

    with live_server(build_artifact(tmp_path)) as (base, _):
        request = {"model": MODEL, "messages": [{"role": "user", "content": "w1"}],
                   "tools": [WEATHER], "max_tokens": 3}
        reply = httpx.post(f"{base}/v1/chat/completions", json=request)
        assert reply.status_code == 400
        assert "Qwen2.5/Qwen3's <tool_call>" in reply.json()["error"]["message"]
        reply = httpx.post(f"{base}/v1/chat/completions",
                           json={**request, "tools": [{"type": "function", "function": {
                               "name": "f"}}], "tool_choice": "none"})
        assert reply.status_code == 200
