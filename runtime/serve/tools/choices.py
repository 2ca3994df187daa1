"""ChoiceReplies: each choice of a chat response, read for tool calls when the request's
tools ask for it (whole, or as stream deltas), or passed through as plain text."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from llmopt.runtime.output import RequestOutput
from llmopt.runtime.serve.responses import ResponseBuilder
from llmopt.runtime.serve.tools.reply import ToolReply
from llmopt.runtime.serve.tools.request import ToolPlan
from llmopt.runtime.serve.tools.text import reply_text
from llmopt.runtime.tokenizer import Tokenizer


class ChoiceReplies:
    """Each choice's reply read for tool calls, when the request's tools ask for it."""

    def __init__(self, tokenizer: Tokenizer, end_ids: Collection[int], tools: ToolPlan | None,
                 n: int):
        self.tokenizer = tokenizer
        self.end_ids = set(end_ids)
        parse = tools is not None and tools.parses_calls and tools.format is not None
        self.replies = [ToolReply(tools.format) for _ in range(n)] if parse else None

    def choice(self, builder: ResponseBuilder, index: int,
               output: RequestOutput) -> dict[str, Any]:
        if self.replies is None:
            return builder.choice(index, output.text, output.finish_reason, output.logprobs)
        content, calls = self.replies[index].whole(self._text(output))
        return builder.choice(index, content, _finish(output, bool(calls)), output.logprobs,
                              tool_calls=calls)

    def delta(self, index: int, output: RequestOutput,
              sent: int) -> tuple[str, list[dict[str, Any]], str | None]:
        """(content delta, tool call deltas, finish reason) of an output."""
        if self.replies is None:
            return output.text[sent:], [], output.finish_reason
        reply = self.replies[index]
        content, calls = reply.delta(self._text(output), output.finished)
        return content, calls, _finish(output, bool(reply.calls))

    def _text(self, output: RequestOutput) -> str:
        return reply_text(self.tokenizer, output, self.end_ids)


def _finish(output: RequestOutput, called: bool) -> str | None:
    return "tool_calls" if called and output.finish_reason == "stop" else output.finish_reason
