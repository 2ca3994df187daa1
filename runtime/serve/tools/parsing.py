"""Reading tool calls out of a reply as it grows: a small scanner over (partial) JSON.

A call is a JSON object with a string `name` and its arguments under `arguments` (or
`parameters`, Llama's key) at its top level. While an object is still open, everything
after its arguments key belongs to the arguments (the object has not closed yet), so the
arguments text can be streamed as it grows; once it closes, `raw_decode` gives its end.
Arguments are the model's own JSON text, so the streamed pieces add up to the final string.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")
WHITESPACE = " \t\n\r"
_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class PartialCall:
    name: str | None  # None until the name's string has closed
    arguments: str  # the arguments text so far ("" before they start)
    complete: bool  # the call's object has closed


def partial_calls(region: str) -> list[PartialCall]:
    """The calls in a tool-call region so far: each JSON object not nested in another."""
    calls, i = [], 0
    while (start := region.find("{", i)) >= 0:
        members, end = scan_members(region, start)
        calls.append(_call(region, members, end))
        if end is None:
            break
        i = end
    return calls


def _call(text: str, members: dict[str, int], end: int | None) -> PartialCall:
    name = None
    if "name" in members:
        value = _complete_value(text, members["name"])
        name = value if isinstance(value, str) else None
    arguments = ""
    key = next((k for k in ARGUMENT_KEYS if k in members), None)
    if key is not None:
        start = members[key]
        if text[start : start + 1] == "{":
            decoded = _raw_decode(text, start)
            arguments = text[start : decoded[1]] if decoded else text[start:]
        elif end is not None:  # a string or other value: known once the call closed
            value = _complete_value(text, start)
            arguments = value if isinstance(value, str) else json.dumps(value)
    return PartialCall(name, arguments, end is not None)


def scan_members(text: str, start: int) -> tuple[dict[str, int], int | None]:
    """Top-level keys of the object opening at text[start] -> where each one's value
    starts; and the index just past the object (None while it is still open)."""
    members: dict[str, int] = {}
    depth, i, n = 0, start, len(text)
    while i < n:
        char = text[i]
        if char == '"':
            end = _string_end(text, i)
            if end is None:
                return members, None
            colon = _skip_whitespace(text, end)
            if depth == 1 and colon < n and text[colon] == ":":
                members[json.loads(text[i:end])] = _skip_whitespace(text, colon + 1)
                end = colon + 1
            i = end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return members, i + 1
        i += 1
    return members, None


def _string_end(text: str, start: int) -> int | None:
    """Index just past the JSON string opening at text[start]; None if unterminated."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def _raw_decode(text: str, start: int) -> tuple[object, int] | None:
    try:
        return _decoder.raw_decode(text, start)
    except json.JSONDecodeError:
        return None


def _complete_value(text: str, start: int) -> object | None:
    decoded = _raw_decode(text, start)
    if decoded is None or decoded[1] >= len(text) and text[start] not in '"{[':
        return None  # a bare number or literal at the very end may still grow
    return decoded[0]
