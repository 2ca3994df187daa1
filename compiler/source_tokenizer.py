"""The source's tokenizer as transformers takes it: tokenizer.json plus the manifest spec.

transformers builds the tokenizer (from tokenizer.json / tokenizer_config.json, or from a
GGUF file's `tokenizer.ggml.*` metadata); what it adds around text — a BOS, an EOS — is
read off its own output on a probe, not from flags that its post-processor may
override. `tokenizer_check` then verifies the artifact's tokenizer against it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt.compiler.tokenizer_check import PROBE_TEXT, TokenizerMismatchError
from llmopt.runtime.tokenizer_spec import TokenizerSpec

TOKENIZER_FILE = "tokenizer.json"
_SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                 "special_tokens_map.json", "generation_config.json")
# Generation-config fields transformers applies that the runtime has no counterpart for,
# with the value at which they do nothing.
_UNSUPPORTED_GENERATION = {"num_beams": 1, "no_repeat_ngram_size": 0, "typical_p": 1.0,
                           "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "bad_words_ids": None,
                           "suppress_tokens": None, "begin_suppress_tokens": None,
                           "forced_bos_token_id": None, "forced_eos_token_id": None}


@dataclass(frozen=True)
class SourceTokenizer:
    """transformers' tokenizer of a checkpoint, and what the artifact will carry of it."""

    hf: Any  # the transformers tokenizer (the reference for the self-check)
    files: dict[str, bytes]  # artifact file name -> content
    spec: TokenizerSpec


def read_source_tokenizer(location: str, gguf_file: str | None, config: Any) -> SourceTokenizer:
    """Load the tokenizer as transformers does and derive the artifact's spec from it
    (before the weights: a tokenizer the artifact cannot reproduce fails fast)."""
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    hf = AutoTokenizer.from_pretrained(location, **kwargs)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise TokenizerMismatchError(
            f"the tokenizer of {location} ({type(hf).__name__}) has no `tokenizers` form "
            "(tokenizer.json) for the runtime to load")
    content = backend.to_str()
    bos_id, eos_id = added_special_ids(hf)
    spec = TokenizerSpec(
        file=TOKENIZER_FILE,
        chat_template=getattr(hf, "chat_template", None),
        add_bos_token=bos_id is not None,
        add_eos_token=eos_id is not None,
        bos_token=_token(hf, bos_id, hf.bos_token),
        eos_token=hf.eos_token,
        bos_token_id=bos_id if bos_id is not None else hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
        pad_token=hf.pad_token,
        pad_token_id=hf.pad_token_id,
        template_tokens=dict(hf.special_tokens_map),
        kind=describe_backend(json.loads(content)),
        source=_source_description(location, gguf_file),
        notes=tokenizer_notes(hf, location, gguf_file, config, bos_id),
    )
    return SourceTokenizer(hf=hf, files={TOKENIZER_FILE: content.encode()}, spec=spec)


def added_special_ids(hf: Any) -> tuple[int | None, int | None]:
    """(BOS, EOS) ids transformers adds around plain text, None where it adds nothing;
    anything else it adds is refused, naming it."""
    plain = hf(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    full = hf(PROBE_TEXT)["input_ids"]
    starts = [k for k in range(len(full) - len(plain) + 1) if full[k:k + len(plain)] == plain]
    if not starts:
        raise TokenizerMismatchError(
            "the source tokenizer's special tokens change how the text itself is tokenized; "
            "the artifact cannot reproduce that")
    prefix, suffix = full[:starts[0]], full[starts[0] + len(plain):]
    if len(prefix) > 1 or len(suffix) > 1 or (suffix and suffix[0] != hf.eos_token_id):
        raise TokenizerMismatchError(
            f"the source tokenizer adds {hf.convert_ids_to_tokens(prefix)} before and "
            f"{hf.convert_ids_to_tokens(suffix)} after text; the artifact reproduces one "
            "BOS before and the EOS after, nothing else")
    return (prefix[0] if prefix else None), (suffix[0] if suffix else None)


def describe_backend(tokenizer_json: dict[str, Any]) -> str:
    """One line on the tokenizer's kind: model, byte fallback, normalizer, pre-tokenizer."""
    model = tokenizer_json.get("model") or {}
    parts = [model.get("type", "?") + (" (byte fallback)" if model.get("byte_fallback") else "")]
    for stage in ("normalizer", "pre_tokenizer"):
        if tokenizer_json.get(stage):
            parts.append(f"{stage.replace('_', '-')} {_stage_types(tokenizer_json[stage])}")
    return "; ".join(parts)


def _stage_types(stage: dict[str, Any]) -> str:
    inner = stage.get("normalizers") or stage.get("pretokenizers")
    return "+".join(_stage_types(s) for s in inner) if inner else stage.get("type", "?")


def _token(hf: Any, token_id: int | None, default: str | None) -> str | None:
    return hf.convert_ids_to_tokens(token_id) if token_id is not None else default


def _source_description(location: str, gguf_file: str | None) -> str:
    if gguf_file:
        return f"GGUF metadata of {gguf_file} (tokenizer.ggml.*), as transformers converts it"
    present = [f for f in _SOURCE_FILES if (Path(location) / f).is_file()]
    return ", ".join(present) or location


def tokenizer_notes(hf: Any, location: str, gguf_file: str | None, config: Any,
                    bos_id: int | None) -> list[str]:
    """Where the source's tokenizer is ambiguous, in words: each note says what the
    artifact does (always what transformers does)."""
    notes = []
    if gguf_file and "tokenizer.ggml.add_bos_token" not in _gguf_fields(location, gguf_file):
        done = f"prepends {hf.convert_ids_to_tokens(bos_id)!r}" if bos_id is not None else (
            "adds none")
        notes.append("the GGUF file does not say whether to add BOS (no "
                     f"tokenizer.ggml.add_bos_token); transformers {done}, and so does the "
                     "artifact")
    config_bos = getattr(config, "bos_token_id", None)
    if bos_id is not None and config_bos is not None and config_bos != bos_id:
        notes.append(f"config.bos_token_id is {config_bos}, but the tokenizer prepends "
                     f"{bos_id} ({hf.convert_ids_to_tokens(bos_id)!r}); the artifact prepends "
                     f"{bos_id}, as transformers does")
    if not getattr(hf, "chat_template", None):
        notes.append("the source has no chat template: chat prompts will be refused")
    return notes


def generation_notes(hf: Any, location: str, gguf_file: str | None,
                     generation_config: Any) -> list[str]:
    """What the generation config (or a GGUF file) asks for that the artifact, like
    transformers, does not do."""
    notes = []
    if gguf_file:
        notes += _end_of_turn_notes(_gguf_fields(location, gguf_file), hf, generation_config)
    for key, inert in _UNSUPPORTED_GENERATION.items():
        value = getattr(generation_config, key, None)
        if value is not None and value != inert:
            notes.append(f"generation config sets {key}={value!r}, which the runtime does not "
                         "implement; ignored")
    return notes


def _gguf_fields(location: str, gguf_file: str) -> dict[str, Any]:
    from gguf import GGUFReader

    return GGUFReader(str(Path(location) / gguf_file)).fields


def _end_of_turn_notes(fields: dict[str, Any], hf: Any, generation_config: Any) -> list[str]:
    notes = []
    eos = _as_list(getattr(generation_config, "eos_token_id", None))
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in fields and (token := int(fields[key].contents())) not in eos:
            notes.append(f"the GGUF file names {hf.convert_ids_to_tokens(token)!r} ({token}) as "
                         f"{key.rsplit('.', 1)[1].removesuffix('_token_id')} token, but "
                         "transformers does not stop there and neither does the artifact (pass "
                         "it in stop_token_ids to stop there)")
    return notes


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
