"""The manifest's tokenizer section: how text becomes the ids the source model expects.

The compiler takes every field from transformers' tokenizer on the source (an HF
directory, a GGUF file's `tokenizer.ggml.*` metadata, a pre-quantized checkpoint) and
checks the result against it on a probe text; the runtime applies exactly this. Fields
after `eos_token` came with source-fidelity checks; older manifests lack them and get
the defaults (ids looked up by token text, no EOS appended, no notes).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class TokenizerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str  # tokenizer.json, relative to the artifact directory
    chat_template: str | None = None
    add_bos_token: bool = False  # prepend bos_token_id to encoded text (not to chat prompts)
    bos_token: str | None = None
    eos_token: str | None = None
    add_eos_token: bool = False  # append eos_token_id to encoded text
    bos_token_id: int | None = None  # None: the id of `bos_token` in the vocabulary
    eos_token_id: int | None = None  # the tokenizer's EOS; generation stops at ModelSpec's list
    pad_token: str | None = None
    pad_token_id: int | None = None
    # What a chat template sees besides the messages, as transformers passes it: the
    # named special tokens (bos_token, eos_token, unk_token, pad_token, ...).
    template_tokens: dict[str, str] = Field(default_factory=dict)
    # For people and `llmopt inspect`, never read by the runtime loop:
    kind: str | None = None  # e.g. "BPE (byte fallback); pre-tokenizer Metaspace"
    source: str | None = None  # where transformers read it: GGUF metadata or the files
    notes: list[str] = Field(default_factory=list)  # ambiguities in the source, resolved
    self_check: dict[str, Any] = Field(default_factory=dict)  # the compile-time comparison

    def summary(self) -> str:
        """One line for people: what is added around text, the template, the self-check."""
        bos = f"adds BOS {self.bos_token!r} ({self.bos_token_id})" if self.add_bos_token else (
            "adds no BOS")
        eos = f"adds EOS {self.eos_token!r} ({self.eos_token_id})" if self.add_eos_token else (
            "adds no EOS")
        parts = [bos, eos, "chat template" if self.chat_template else "no chat template"]
        check = self.self_check
        if check:
            counted = f"{check.get('probe_tokens')} probe"
            if isinstance(check.get("chat_tokens"), int):
                counted += f" + {check['chat_tokens']} chat"
            parts.append(f"matches transformers {check.get('transformers')} on {counted} tokens")
        return ", ".join(parts)
