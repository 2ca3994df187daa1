"""Tool calls read back from replies, whole and streamed, for each family's format."""

from __future__ import annotations

import json

import pytest

from llmopt.runtime.serve.tools.formats import HERMES, LLAMA3, MISTRAL
from llmopt.runtime.serve.tools.parsing import PartialCall, partial_calls
from llmopt.runtime.serve.tools.reply import ToolReply

ARGS = '{"city": "Paris", "nested": {"a": [1, 2, {"b": "}"}]}, "s": "x\\"}"}'
REPLIES = {
    "hermes": (HERMES, f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": '
                       f'{ARGS}}}\n</tool_call>\n<tool_call>\n{{"name": "add", "arguments": '
                       f'{{"a": 1}}}}\n</tool_call>'),
    "llama3": (LLAMA3, f'{{"name": "get_weather", "parameters": {ARGS}}}'),
    "llama3-python-tag": (LLAMA3, f'<|python_tag|>{{"name": "get_weather", "parameters": '
                                  f'{ARGS}}}'),
    "mistral": (MISTRAL, f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {ARGS}}}, '
                         f'{{"name": "add", "arguments": {{"a": 1}}}}]'),
}
EXPECTED_CALLS = {"hermes": 2, "llama3": 1, "llama3-python-tag": 1, "mistral": 2}


@pytest.mark.parametrize("name", REPLIES)
def test_whole_reply_gives_content_and_calls(name):
    fmt, text = REPLIES[name]
    content, calls = ToolReply(fmt).whole(text)
    assert content == ("Let me look.\n" if name == "hermes" else None)
    assert len(calls) == EXPECTED_CALLS[name]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ARGS}
    assert json.loads(calls[0]["function"]["arguments"])["nested"]["a"][2] == {"b": "}"}
    assert calls[0]["type"] == "function" and len({c["id"] for c in calls}) == len(calls)
    if name == "mistral":
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)


@pytest.mark.parametrize("name", REPLIES)
def test_streamed_deltas_add_up_to_the_whole_reply(name):
    """Fed one character at a time: content never shows a marker, each call's header
    comes once before its arguments, and the pieces join to the final arguments."""
    fmt, text = REPLIES[name]
    reply = ToolReply(fmt)
    content, headers, arguments = "", [], {}
    for end in range(1, len(text) + 1):
        delta, calls = reply.delta(text[:end], end == len(text))
        content += delta
        for call in calls:
            if "id" in call:
                headers.append(call["index"])
                assert call["function"]["arguments"] == ""
            else:
                assert call["index"] in headers
                arguments[call["index"]] = (arguments.get(call["index"], "")
                                            + call["function"]["arguments"])
    whole_content, whole_calls = ToolReply(fmt).whole(text)
    assert content == (whole_content or "")
    assert "<tool" not in content and "TOOL" not in content
    assert headers == list(range(len(whole_calls)))
    assert [arguments[i] for i in headers] == [c["function"]["arguments"] for c in whole_calls]


def test_a_marker_that_leads_to_no_call_is_text_after_all():
    reply = ToolReply(HERMES)
    text = "I would use <tool_call> here, but no."
    streamed = "".join(reply.delta(text[:end], end == len(text))[0]
                       for end in range(1, len(text) + 1))
    assert streamed == text
    assert ToolReply(HERMES).whole(text) == (text, [])
    assert ToolReply(LLAMA3).whole("  Plain answer.") == ("  Plain answer.", [])


def test_partial_calls_know_what_is_complete():
    assert partial_calls('{"name": "f", "argu') == [PartialCall("f", "", False)]
    assert partial_calls('{"name": "f", "arguments": {"x": "a,b') == [
        PartialCall("f", '{"x": "a,b', False)]
    assert partial_calls('{"arguments": {"x": 1}, "name": "g"} trailing') == [
        PartialCall("g", '{"x": 1}', True)]
    assert partial_calls('{"name": "f", "arguments": "{\\"x\\": 1}"}') == [
        PartialCall("f", '{"x": 1}', True)]  # arguments sent as a JSON string
    assert partial_calls('{"na') == [PartialCall(None, "", False)]
