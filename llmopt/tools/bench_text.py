"""Realistic benchmark prompts from the passages built into the package (runtime/texts.py).

Random token ids make a model repeat itself, which anything that guesses the next tokens
from earlier ones (prompt lookup, a small model) then gets right every time: a fair bench
needs text, tokenized with the artifact's own tokenizer.
"""

from __future__ import annotations

from llmopt.runtime.texts import PASSAGES
from llmopt.runtime.tokenizer import Tokenizer

# What a user asks about the passages (chat prompts), one per prompt in turn.
REQUESTS = (
    "Summarize the text above in two sentences.",
    "What is the main point of the text above, and who would find it useful?",
    "Rewrite the first paragraph above in simpler words for a ten-year-old.",
    "Write three questions a reader might ask after reading the text above.",
)
_SLOT = "\x00content\x00"  # where the user's message sits in the rendered template


def text_prompts(tokenizer: Tokenizer, batch: int, prompt_len: int) -> list[list[int]]:
    """`batch` distinct prompts of exactly `prompt_len` tokens.

    With a chat template (an instruct model), each is a chat request: passages cut to fit,
    a question about them, then the assistant's turn; otherwise plain passages. Prompt i
    starts at passage i and runs on through the next ones (numbered past the last passage),
    so no two share a block past the chat template's own opening (its system prompt, which
    real chat traffic shares too).
    """
    template = _chat_frame(tokenizer, prompt_len)
    prompts = []
    for i in range(batch):
        start = i % len(PASSAGES)
        order = PASSAGES[start:] + PASSAGES[:start]
        text = (f"({i // len(PASSAGES)}) " if i >= len(PASSAGES) else "") + "\n\n".join(order)
        if template is None:
            prompts.append(_fill(tokenizer, tokenizer.encode(text, add_eos=False), order,
                                 prompt_len))
            continue
        before, after = template
        request = _plain(tokenizer, f"\n\n{REQUESTS[i % len(REQUESTS)]}")
        room = prompt_len - len(before) - len(after) - len(request)
        body = _fill(tokenizer, _plain(tokenizer, text), order, room) if room > 0 else []
        prompts.append((before + body + request)[:prompt_len - len(after)] + after)
    return prompts


def _chat_frame(tokenizer: Tokenizer, prompt_len: int) -> tuple[list[int], list[int]] | None:
    """Token ids before and after the user's message; None without a chat template or
    when the frame would take more than a quarter of the prompt."""
    if tokenizer.spec.chat_template is None:
        return None
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _SLOT}])
    if rendered.count(_SLOT) != 1:
        return None
    before, after = (_plain(tokenizer, part) for part in rendered.split(_SLOT))
    return (before, after) if len(before) + len(after) <= prompt_len // 4 else None


def _plain(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_bos=False, add_eos=False)


def _fill(tokenizer: Tokenizer, ids: list[int], order: tuple[str, ...], length: int) -> list[int]:
    while len(ids) < length:  # longer than every passage together: keep going
        ids = ids + _plain(tokenizer, "\n\n" + "\n\n".join(order))
    return ids[:length]
