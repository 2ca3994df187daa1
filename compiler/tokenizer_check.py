"""Compile-time self-check: the artifact's tokenizer against transformers' on the source.

The runtime's `Tokenizer`, built from exactly what the artifact will hold (tokenizer.json
and the manifest's tokenizer spec), must give transformers' ids for a fixed probe text,
its chat-templated ids for a fixed conversation, and its decoded text. A mismatch fails
the compile with one line naming the first difference.
"""

from __future__ import annotations

from typing import Any

# Words, digits, punctuation, runs of spaces, a tab, newlines, accents, CJK and an emoji:
# what separates byte-level BPE, SentencePiece byte fallback and their normalizers.
PROBE_TEXT = ("Hello world! It's 2024: naïve café, 3.14 × 2 = 6.28.\n"
              "  Two  spaces,\ttab; 東京 and 😀 — done.")
PROBE_CHAT = [
    {"role": "user", "content": "Why is the sky blue?"},
    {"role": "assistant", "content": " Rayleigh scattering. "},
    {"role": "user", "content": "And at sunset?\n"},
]


class TokenizerMismatchError(ValueError):
    """The artifact's tokenizer would not reproduce transformers' on the source."""


def check_tokenizer(hf: Any, tokenizer_json: str, spec: Any) -> dict[str, Any]:
    """Compare the runtime tokenizer with transformers' `hf`; the report on success."""
    import tokenizers
    import transformers

    from llmopt.runtime.tokenizer import Tokenizer

    runtime = Tokenizer(tokenizers.Tokenizer.from_str(tokenizer_json), spec)
    text = " ".join([PROBE_TEXT, *_added_tokens(hf)])
    expected = hf(text)["input_ids"]
    _compare_ids("the probe text", expected, runtime.encode(text), hf)
    _compare_text("decoding the probe text", hf.decode(expected, skip_special_tokens=True),
                  runtime.decode(expected, skip_special_tokens=True))
    report = {"transformers": transformers.__version__, "probe_tokens": len(expected)}
    if spec.chat_template:
        report["chat_tokens"] = _check_chat(hf, runtime)
    return report


def _added_tokens(hf: Any, most: int = 64) -> list[str]:
    """Special tokens, then up to `most` other added ones (Qwen3's <think>): inside text
    they must stay whole, with the same stripping of spaces around them, in both."""
    special = set(hf.all_special_tokens)
    others = [t.content for _, t in sorted(hf.added_tokens_decoder.items())
              if t.content not in special]
    return [*hf.all_special_tokens, *others[:most]]


def _check_chat(hf: Any, runtime: Any) -> int | str:
    """Chat-templated ids of PROBE_CHAT; a template that rejects it must do so in both."""
    try:
        text = hf.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - the template's own error, checked below
        try:
            runtime.apply_chat_template(PROBE_CHAT)
        except Exception:  # noqa: BLE001
            return f"the template rejects the probe conversation: {exc}"
        raise TokenizerMismatchError(
            f"the chat template fails in transformers ({exc}) but renders in the artifact"
        ) from exc
    _compare_text("the chat template", text, runtime.apply_chat_template(PROBE_CHAT))
    expected = hf.apply_chat_template(PROBE_CHAT, add_generation_prompt=True)["input_ids"]
    _compare_ids("the chat-templated probe", expected, runtime.encode_chat(PROBE_CHAT), hf)
    return len(expected)


def _compare_ids(what: str, expected: list[int], actual: list[int], hf: Any) -> None:
    if actual == expected:
        return
    i = _first_difference(expected, actual)
    raise TokenizerMismatchError(
        f"tokenizer self-check failed on {what}: transformers gives {len(expected)} tokens, "
        f"the artifact {len(actual)}; first difference at token {i}: transformers "
        f"{_describe(expected, i, hf)}, the artifact {_describe(actual, i, hf)}")


def _describe(ids: list[int], i: int, hf: Any) -> str:
    return f"{ids[i]} {hf.convert_ids_to_tokens(ids[i])!r}" if i < len(ids) else "nothing"


def _compare_text(what: str, expected: str, actual: str) -> None:
    if actual == expected:
        return
    i = _first_difference(expected, actual)
    raise TokenizerMismatchError(
        f"tokenizer self-check failed on {what}: the texts differ at character {i}: "
        f"transformers {expected[i:i + 24]!r}, the artifact {actual[i:i + 24]!r}")


def _first_difference(expected: Any, actual: Any) -> int:
    common = min(len(expected), len(actual))
    return next((i for i in range(common) if expected[i] != actual[i]), common)
