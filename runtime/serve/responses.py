"""OpenAI response bodies, built as plain dicts (the hot path of a stream: no models)."""

from __future__ import annotations

import json
import time
from typing import Any

from llmopt.runtime.logprobs import TokenLogprob
from llmopt.runtime.tokenizer import Tokenizer


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class ResponseBuilder:
    """Bodies of one HTTP request's response: chat or text completion, whole or chunks."""

    def __init__(self, chat: bool, response_id: str, model: str, tokenizer: Tokenizer):
        self.chat = chat
        self.id = response_id
        self.model = model
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def response(self, choices: list[dict[str, Any]], usage_: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope(self.object, choices), "usage": usage_}

    def choice(self, index: int, text: str | None, finish_reason: str | None,
               logprobs: list[TokenLogprob] | None,
               tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A whole choice (non-streamed)."""
        body: dict[str, Any] = {"index": index, "finish_reason": finish_reason,
                                "logprobs": self.logprobs(logprobs)}
        if self.chat:
            body["message"] = {"role": "assistant", "content": text}
            if tool_calls:
                body["message"]["tool_calls"] = tool_calls
        else:
            body["text"] = text
        return body

    def chunk(self, index: int, text: str | None, finish_reason: str | None,
              logprobs: list[TokenLogprob] | None, first: bool = False,
              text_offset: int = 0,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """One streamed delta of one choice; `text_offset`: the choice's text before it;
        `tool_calls`: deltas of the calls (OpenAI's: index, then id/type/name once, then
        pieces of the arguments)."""
        body: dict[str, Any] = {"index": index, "finish_reason": finish_reason,
                                "logprobs": self.logprobs(logprobs, text_offset)}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None and (text or not tool_calls):
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            body["delta"] = delta
        else:
            body["text"] = text or ""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(obj, [body])

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage_}

    def logprobs(self, entries: list[TokenLogprob] | None,
                 text_offset: int = 0) -> dict[str, Any] | None:
        if entries is None:
            return None
        if self.chat:
            return {"content": [self._chat_logprob(e) for e in entries]}
        tokens = [self._token(e.token_id) for e in entries]
        offsets, offset = [], text_offset
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def _chat_logprob(self, entry: TokenLogprob) -> dict[str, Any]:
        token = self._token(entry.token_id)
        return {"token": token, "logprob": entry.logprob, "bytes": list(token.encode()),
                "top_logprobs": [{"token": (t := self._token(i)), "logprob": lp,
                                  "bytes": list(t.encode())} for i, lp in entry.top]}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
