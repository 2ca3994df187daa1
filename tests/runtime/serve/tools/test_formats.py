"""Each family's tool-call format: found in its chat template, and a grammar that accepts
exactly calls of the tools offered, written the way the template writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_tool_artifact import QWEN2_5_TEMPLATE

from llmopt.runtime import LLM
from llmopt.runtime.serve.tools import formats
from llmopt.runtime.serve.tools.formats import HERMES, LLAMA3, MISTRAL, detect_tool_format
from llmopt.runtime.structured import StructuredOutputsParams

LLAMA31_FRAGMENT = (  # the JSON tool-call lines of Llama 3.1's template
    '{%- if tools is not none %}{{- "Given the following functions, please respond with a '
    'JSON for a function call with its proper arguments." }}{%- endif %}'
    '{{- \'{"name": "\' + tool_call.name + \'", \' }}{{- \'"parameters": \' }}'
    '{{- tool_call.arguments | tojson }}{{- "<|eot_id|>" }}')
MISTRAL_V3_FRAGMENT = (
    '{%- if tools is not none %}{{- "[AVAILABLE_TOOLS] [" }}{%- endif %}'
    '{{- "[TOOL_CALLS] [" }}{{- tool_call.arguments | tojson }}')
SMOLLM2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
           "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}")
WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
CALL = {"city": "Paris", "unit": "c"}


def test_the_format_is_read_off_the_template():
    assert detect_tool_format(QWEN2_5_TEMPLATE.read_text()) is HERMES
    assert detect_tool_format(LLAMA31_FRAGMENT) is LLAMA3
    assert detect_tool_format(MISTRAL_V3_FRAGMENT) is MISTRAL
    assert detect_tool_format(MISTRAL_V3_FRAGMENT + "[ARGS]") is None  # tekken v11 form
    assert detect_tool_format(SMOLLM2) is None and detect_tool_format(None) is None


@pytest.fixture(scope="module")
def llm(tool_artifact: Path) -> LLM:
    return LLM(tool_artifact, speculative=False)


def accepts(llm: LLM, grammar: str, text: str, marker_id: int | None = None) -> bool:
    """Whether the whole of `text` (after a special marker token) is a complete match."""
    matcher = llm.engine.structured.matcher(StructuredOutputsParams(grammar=grammar))
    tokens = ([marker_id] if marker_id is not None else []) + llm.tokenizer.encode(
        text, add_bos=False, add_eos=False)
    return matcher.validate_tokens(tokens) == len(tokens) and (
        matcher.consume_tokens(tokens) and matcher.is_accepting())


def test_hermes_grammar_accepts_what_the_template_renders(llm):
    """The call as Qwen2.5's template writes an assistant's tool call is what the
    grammar forces; another function, or missing arguments, is not."""
    rendered = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": CALL}}]}],
        add_generation_prompt=False)
    reply = rendered.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert reply.startswith("<tool_call>\n{")
    grammar = formats.grammar(HERMES, [WEATHER, ADD], parallel=True, special_ids={})
    assert accepts(llm, grammar, reply)
    assert accepts(llm, grammar, reply + "\n" + reply.replace("get_weather", "add").replace(
        json.dumps(CALL), '{"a": 1, "b": 2}'))
    assert not accepts(llm, grammar, reply.replace("get_weather", "get_time"))
    assert not accepts(llm, grammar, reply.replace('"unit": "c"', '"unit": "k"'))
    single = formats.grammar(HERMES, [WEATHER], parallel=False, special_ids={})
    assert accepts(llm, single, reply) and not accepts(llm, single, reply + "\n" + reply)


def test_llama3_and_mistral_grammars(llm):
    call = json.dumps({"name": "get_weather", "parameters": CALL})
    assert accepts(llm, formats.grammar(LLAMA3, [WEATHER], True, {}), call)
    calls = json.dumps([{"name": "get_weather", "arguments": CALL},
                        {"name": "add", "arguments": {"a": 1, "b": 2}}])
    mistral = formats.grammar(MISTRAL, [WEATHER, ADD], True, {})
    assert accepts(llm, mistral, "[TOOL_CALLS] " + calls)
    assert not accepts(llm, formats.grammar(MISTRAL, [WEATHER, ADD], False, {}),
                       "[TOOL_CALLS] " + calls)  # one call only
    # where the marker is a special token the grammar names it by id, not by its text
    special = llm.tokenizer.encode("<|im_start|>", add_bos=False)
    assert len(special) == 1
    marked = formats.grammar(MISTRAL, [WEATHER], True, {"[TOOL_CALLS]": special[0]})
    one = json.dumps([{"name": "get_weather", "arguments": CALL}])
    assert accepts(llm, marked, " " + one, marker_id=special[0])
    assert not accepts(llm, marked, "[TOOL_CALLS] " + one)


def test_tools_render_through_the_template_as_transformers_renders_them(tool_artifact, llm):
    """tools=[...] and a call -> tool -> answer history, through the artifact's template
    (runtime, jinja) and transformers' apply_chat_template on the checkpoint: the same."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tool_artifact.parent / "checkpoint" / "hf")
    tools = [{"type": "function", "function": {**WEATHER, "description": "Weather now"}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": CALL}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    expected = hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                      add_generation_prompt=True)
    assert '"name": "get_weather"' in expected and "<tool_response>" in expected
    assert llm.tokenizer.apply_chat_template(messages, tools=tools) == expected
