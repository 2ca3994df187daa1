"""Tokenizer: text <-> token ids with the artifact's tokenizer.json, and its chat template.

BOS/EOS handling comes from the manifest, not from the tokenizer's post-processor: text
is encoded without special tokens, then BOS is prepended and EOS appended as
`add_bos_token`/`add_eos_token` say (the compiler read both off transformers' tokenizer
on the source). A chat template writes its own special tokens, so chat prompts get none
added, as in transformers' `apply_chat_template`.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmopt.runtime.tokenizer_spec import TokenizerSpec

Message = dict[str, Any]


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, spec: TokenizerSpec):
        self.tokenizer = tokenizer
        self.spec = spec
        self.bos_token_id = _first(spec.bos_token_id, self._token_id(spec.bos_token))
        self.eos_token_id = _first(spec.eos_token_id, self._token_id(spec.eos_token))
        if spec.add_bos_token and self.bos_token_id is None:
            raise ValueError("the manifest asks for add_bos_token but names no known bos_token")
        if spec.add_eos_token and self.eos_token_id is None:
            raise ValueError("the manifest asks for add_eos_token but names no known eos_token")

    @classmethod
    def from_file(cls, path: str | Path, spec: TokenizerSpec) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)), spec)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None,
               add_eos: bool | None = None) -> list[int]:
        """Token ids of `text`, with BOS first and EOS last when the manifest (or the
        arguments) ask for them."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.spec.add_bos_token if add_bos is None else add_bos:
            ids = [self.bos_token_id, *ids]
        if self.spec.add_eos_token if add_eos is None else add_eos:
            ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if self.spec.chat_template is None:
            raise ValueError("this artifact's tokenizer has no chat template")
        tokens = self.spec.template_tokens or {  # older manifests: BOS and EOS only
            "bos_token": self.spec.bos_token or "", "eos_token": self.spec.eos_token or ""}
        return render_chat_template(
            self.spec.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **{**tokens, **kwargs},
        )

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """`kwargs` reach the template as variables (`tools=[...]`, as transformers')."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        **kwargs)
        return self.encode(text, add_bos=False, add_eos=False)  # the template wrote its own

    @functools.cached_property
    def byte_token_ids(self) -> frozenset[int]:
        """Ids of byte-fallback tokens (<0x00>..<0xFF>); empty without byte fallback."""
        if not getattr(self.tokenizer.model, "byte_fallback", False):
            return frozenset()
        ids = (self.tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def render_chat_template(template: str, messages: list[Message], **variables: Any) -> str:
    """Render an HF chat template the way transformers does (sandboxed jinja2): keys
    whose value is None are dropped from messages, and `tools`/`documents` are None
    rather than undefined unless given."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    variables = {"tools": None, "documents": None, **variables}
    return _compile_template(template).render(messages=messages, **variables)


@functools.lru_cache(maxsize=8)
def _compile_template(template: str) -> jinja2.Template:
    # The same environment transformers builds: a template is untrusted code from a
    # checkpoint, so it runs sandboxed and cannot mutate what it is given.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class IncrementalDetokenizer:
    """Text of a growing token list, emitted as deltas that add up to decode(all tokens).

    Each step decodes a short window twice, with and without the new tokens, and emits
    the difference; a window that ends in U+FFFD is an incomplete UTF-8 character (a
    byte-level token split it) and waits for the next token. Decoding a window rather
    than single tokens keeps the spaces that tokenizers strip from a sequence's start.
    A window that ends in a byte-fallback token waits too: the decoder turns a whole run
    of byte tokens into U+FFFD when the run is not valid UTF-8, so text emitted from
    inside a run could later change.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start
        self.read_offset = 0  # tokens before this are already in `text`
        self.text = ""

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        self.token_ids.extend(token_ids)
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        if (len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd")
                or self.token_ids[-1] in self.tokenizer.byte_token_ids):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever a trailing incomplete character left undecoded, at the end of a sequence."""
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
