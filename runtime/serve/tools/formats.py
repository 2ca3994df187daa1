"""The tool-call formats of the families whose chat templates define one, read off the
template itself (what it renders an assistant's tool call as):

  hermes   Qwen2.5, Qwen3 (and Hermes-style templates): <tool_call>\\n{"name": N,
           "arguments": {...}}\\n</tool_call>, one block per call
  llama3   Llama 3.1-3.3 JSON tool calling: the reply is {"name": N, "parameters": {...}}
  mistral  Mistral v3 tokenizers (7B v0.3, Nemo, Small): [TOOL_CALLS] [{"name": N,
           "arguments": {...}}, ...]

`grammar` gives the Lark grammar that forces calls (tool_choice `required` or a named
function); the JSON inside is llguidance's `%json` over each tool's parameter schema.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any

ALNUM = string.ascii_letters + string.digits
# Templates write calls with `tojson` (one space after ',' and ':'): at most that much.
CALL_WHITESPACE = r"\x20?"


@dataclass(frozen=True)
class ToolFormat:
    name: str
    marker: str  # where the calls start ("" for llama3: the reply itself is the call)
    args_key: str  # the key the template writes arguments under
    close: str = ""  # after each call (hermes: </tool_call>)

    def new_call_id(self) -> str:
        """A tool call id the family's template accepts back (Mistral's: 9 alphanumerics)."""
        if self.name == "mistral":
            return "".join(secrets.choice(ALNUM) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"


HERMES = ToolFormat("hermes", "<tool_call>", "arguments", "</tool_call>")
LLAMA3 = ToolFormat("llama3", "", "parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "arguments")


def detect_tool_format(template: str | None) -> ToolFormat | None:
    """The format a chat template renders tool calls in; None when it renders none."""
    if not template or "tools" not in template:
        return None
    if "[TOOL_CALLS]" in template and "[ARGS]" not in template:
        return MISTRAL
    if "<tool_call>" in template:
        return HERMES
    if "<|eot_id|>" in template and '"parameters"' in template:
        return LLAMA3
    return None


def call_schema(fmt: ToolFormat, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call of any of `tools` (OpenAI function definitions)."""
    options = [{
        "type": "object",
        "properties": {"name": {"const": tool["name"]},
                       fmt.args_key: tool.get("parameters") or {"type": "object"}},
        "required": ["name", fmt.args_key], "additionalProperties": False,
    } for tool in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {"x-guidance": {"whitespace_pattern": CALL_WHITESPACE}, **schema}


def grammar(fmt: ToolFormat, tools: list[dict[str, Any]], parallel: bool,
            special_ids: dict[str, int]) -> str:
    """Lark: one call of `tools` (or several with `parallel`), in the family's format.
    `special_ids`: the family's markers that are special tokens of this tokenizer (a
    special token only matches as itself, written <[id]>)."""
    call = json.dumps(call_schema(fmt, tools))
    if fmt is MISTRAL:
        array = {"type": "array", "items": call_schema(fmt, tools), "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        return (f'start: {_literal(fmt.marker, special_ids)} " "? calls\n'
                f"calls: %json {json.dumps(array)}\n")
    if fmt is LLAMA3:
        return f"start: call\ncall: %json {call}\n"
    block = (f'{_literal(fmt.marker, special_ids)} "\\n" call "\\n" '
             f'{_literal(fmt.close, special_ids)}')
    repeat = ' ("\\n" block)*' if parallel else ""
    return f"start: block{repeat}\nblock: {block}\ncall: %json {call}\n"


def _literal(text: str, special_ids: dict[str, int]) -> str:
    return f"<[{special_ids[text]}]>" if text in special_ids else json.dumps(text)
