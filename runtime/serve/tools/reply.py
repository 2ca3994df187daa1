"""ToolReply: one choice's reply split into content and tool calls, whole or as the
deltas OpenAI streams: content first, then per call a chunk with its id, type and name
(arguments ""), then pieces of its arguments as they are written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmopt.runtime.serve.tools.formats import ToolFormat
from llmopt.runtime.serve.tools.parsing import partial_calls

PYTHON_TAG = "<|python_tag|>"  # Llama 3's tool-call lead-in


@dataclass
class _SentCall:
    id: str
    arguments_sent: int = 0


class ToolReply:
    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.content_sent = 0
        self.calls: list[_SentCall] = []

    def split(self, text: str) -> tuple[str, str | None]:
        """(content, the tool-call region after the marker, or None when none began)."""
        if not self.fmt.marker:  # llama3: a reply that is a JSON object is the call
            stripped = text.lstrip()
            if stripped.startswith(PYTHON_TAG):
                return "", stripped[len(PYTHON_TAG):]
            return ("", stripped) if stripped.startswith("{") else (text, None)
        start = text.find(self.fmt.marker)
        if start < 0:
            return text, None
        return text[:start], text[start + len(self.fmt.marker):]

    def whole(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The message's content (None when only calls) and its `tool_calls`."""
        content, region = self.split(text)
        calls = [c for c in partial_calls(region) if c.complete and c.name is not None] \
            if region is not None else []
        if not calls:
            return text, []
        return (content if content.strip() else None,
                [_tool_call(self.fmt.new_call_id(), c.name, c.arguments) for c in calls])

    def delta(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """What is new since the last call: a content delta and `tool_calls` deltas."""
        content, region = self.split(text)
        if region is None:
            visible = content if finished else content[: len(content) - self._held(content)]
            delta, self.content_sent = visible[self.content_sent:], len(visible)
            return delta, []
        delta, self.content_sent = content[self.content_sent:], len(content)
        deltas = self._call_deltas(region)
        if finished and not self.calls:  # the marker led to no call: it was text after all
            delta += text[len(content):]
        return delta, deltas

    def _call_deltas(self, region: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(partial_calls(region)):
            if call.name is None:
                break
            if index == len(self.calls):
                self.calls.append(_SentCall(self.fmt.new_call_id()))
                deltas.append({"index": index, **_tool_call(self.calls[index].id, call.name, "")})
            sent = self.calls[index]
            if len(call.arguments) > sent.arguments_sent:
                deltas.append({"index": index,
                               "function": {"arguments": call.arguments[sent.arguments_sent:]}})
                sent.arguments_sent = len(call.arguments)
        return deltas

    def _held(self, content: str) -> int:
        """Characters at the end of `content` that may still become the marker."""
        marker = self.fmt.marker
        if not marker:  # llama3: until the reply's start shows it is no call
            return len(content) if PYTHON_TAG.startswith(content.lstrip()) else 0
        for size in range(min(len(marker) - 1, len(content)), 0, -1):
            if content.endswith(marker[:size]):
                return size
        return 0


def _tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
