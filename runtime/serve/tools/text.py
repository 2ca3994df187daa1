"""The text tool calls are read from: the reply decoded with special tokens kept (Mistral's
[TOOL_CALLS] and Llama's <|python_tag|> are special tokens the plain text drops), without
the token that ended it, cut at a stop string like the plain text."""

from __future__ import annotations

from collections.abc import Collection

from llmopt.runtime.output import RequestOutput
from llmopt.runtime.tokenizer import Tokenizer


def reply_text(tokenizer: Tokenizer, output: RequestOutput, end_ids: Collection[int]) -> str:
    ids = output.token_ids
    if output.finish_reason == "stop" and ids and ids[-1] in end_ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if isinstance(output.stop_reason, str) and output.stop_reason in text:
        text = text[: text.index(output.stop_reason)]
    if not output.finished:
        text = text.rstrip("\ufffd")  # a character a later token completes
    return text
