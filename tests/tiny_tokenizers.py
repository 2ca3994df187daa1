"""Tiny tokenizers of each supported family's real kind, for source-fidelity tests.

Each is trained offline on a few sentences, then built the way its family ships:
SentencePiece-style BPE with byte fallback and an added BOS (Mistral, Gemma), byte-level
BPE that adds a BOS (Llama 3) or none (Qwen), with the family's special tokens and chat
template. `hf_tokenizer` gives the transformers object an HF directory saves;
`gguf_tokenizer_fields` the `tokenizer.ggml.*` metadata llama.cpp's converter writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "Once upon a time there was a little cat that sat on the mat.",
    "It is named after the engineer who built the first bridge in 1887.",
    "Why is the sky blue? Because air scatters blue light more than red light.",
] * 4

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content']"
    " | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class FamilyTokenizer:
    """One family's tokenizer kind: specials first (in id order), then the vocabulary."""

    kind: str  # "sentencepiece" (byte fallback, ▁ for spaces) or "byte_bpe"
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str | None
    unk: str | None
    add_bos: bool | None  # None: a GGUF file without tokenizer.ggml.add_bos_token
    chat_template: str
    gguf_pre: str = "default"  # tokenizer.ggml.pre: the byte-level split the file names
    prefix_space: bool = True  # SentencePiece: a "▁" before the first word (not Gemma)
    user_defined: tuple[str, ...] = ()  # added, not special (Qwen3's <think>)
    # generation_config.json of the HF form (the GGUF form has none).
    generation: dict[str, Any] = field(default_factory=dict)
    end_of_turn: str | None = None  # tokenizer.ggml.eot_token_id (Gemma's <end_of_turn>)


FAMILY_TOKENIZERS: dict[str, FamilyTokenizer] = {
    "llama": FamilyTokenizer(
        "byte_bpe", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                     "<|end_header_id|>", "<|eot_id|>"),
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, unk=None, add_bos=True,
        chat_template=LLAMA3_TEMPLATE, gguf_pre="llama-bpe",
        generation={"do_sample": True, "temperature": 0.6, "top_p": 0.9,
                    "eos_token_id": ["<|end_of_text|>", "<|eot_id|>"]}),
    "mistral": FamilyTokenizer(
        "sentencepiece", ("<unk>", "<s>", "</s>"), bos="<s>", eos="</s>", pad=None,
        unk="<unk>", add_bos=True, chat_template=MISTRAL_TEMPLATE),
    "qwen2": FamilyTokenizer(
        "byte_bpe", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos=None,
        eos="<|im_end|>", pad="<|endoftext|>", unk=None, add_bos=False,
        chat_template=CHATML_TEMPLATE, gguf_pre="qwen2",
        generation={"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                    "repetition_penalty": 1.05, "eos_token_id": ["<|im_end|>", "<|endoftext|>"]}),
    "qwen3": FamilyTokenizer(
        "byte_bpe", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos=None,
        eos="<|im_end|>", pad="<|endoftext|>", unk=None, add_bos=False,
        chat_template=CHATML_TEMPLATE, gguf_pre="qwen2", user_defined=("<think>", "</think>"),
        generation={"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                    "eos_token_id": ["<|im_end|>", "<|endoftext|>"]}),
    "gemma2": FamilyTokenizer(
        "sentencepiece", ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>",
                          "<end_of_turn>"), bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
        add_bos=True, chat_template=GEMMA_TEMPLATE, prefix_space=False,
        generation={"eos_token_id": ["<eos>", "<end_of_turn>"]}, end_of_turn="<end_of_turn>"),
    "gemma3_text": FamilyTokenizer(
        "sentencepiece", ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>",
                          "<end_of_turn>"), bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
        add_bos=True, chat_template=GEMMA_TEMPLATE, prefix_space=False,
        generation={"do_sample": True, "top_k": 64, "top_p": 0.95,
                    "eos_token_id": ["<eos>", "<end_of_turn>"]},
        end_of_turn="<end_of_turn>"),
}


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]  # in id order
    merges: list[tuple[str, str]]
    scores: list[float]  # SentencePiece: higher merges first; 0 for specials and bytes

    @property
    def ids(self) -> dict[str, int]:
        return {token: i for i, token in enumerate(self.tokens)}


def train_vocabulary(family: FamilyTokenizer, size: int = 160) -> Vocabulary:
    """Specials, then (SentencePiece) the 256 byte-fallback tokens, then trained BPE tokens."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    if family.kind == "sentencepiece":
        scheme = "always" if family.prefix_space else "never"
        bpe.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
        trainer = trainers.BpeTrainer(vocab_size=size, show_progress=False)
    else:
        split = LLAMA3_SPLIT if family.gguf_pre == "llama-bpe" else QWEN2_SPLIT
        bpe.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        trainer = trainers.BpeTrainer(vocab_size=size + 256, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    model = json.loads(bpe.to_str())["model"]
    learned = sorted(model["vocab"], key=model["vocab"].get)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    if family.kind == "sentencepiece":  # specials first, as SentencePiece numbers them
        head = [*family.specials, *(f"<0x{b:02X}>" for b in range(256))]
        tokens = head + [t for t in learned if t not in head] + list(family.user_defined)
        scores = [0.0] * len(head) + [-float(i) for i in range(len(tokens) - len(head))]
    else:  # byte-level vocabularies put their specials after the merges (Llama 3, Qwen)
        tokens = [*learned, *family.specials, *family.user_defined]
        scores = [0.0] * len(tokens)
    return Vocabulary(tokens, merges, scores)


def hf_tokenizer(family: FamilyTokenizer, vocab: Vocabulary) -> Any:
    """The transformers tokenizer an HF directory of this family would save."""
    from tokenizers import AddedToken

    ids = vocab.ids
    if family.kind == "sentencepiece":
        from transformers import GemmaTokenizer, LlamaTokenizer

        cls = GemmaTokenizer if not family.prefix_space else LlamaTokenizer
        specials = {"bos_token": family.bos, "eos_token": family.eos, "unk_token": family.unk}
        if family.pad:
            specials["pad_token"] = family.pad
        tokenizer = cls(vocab=ids, merges=vocab.merges, add_bos_token=family.add_bos, **specials)
    elif family.bos is None:
        from transformers import Qwen2Tokenizer

        tokenizer = Qwen2Tokenizer(vocab=ids, merges=vocab.merges, eos_token=family.eos,
                                   pad_token=family.pad, unk_token=None)
    else:
        tokenizer = _llama3_tokenizer(family, vocab)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                       for t in family.specials]},
        replace_extra_special_tokens=False)
    if family.user_defined:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                              for t in family.user_defined])
    tokenizer.chat_template = family.chat_template
    return tokenizer


def _llama3_tokenizer(family: FamilyTokenizer, vocab: Vocabulary) -> Any:
    """Llama 3 ships a bare PreTrainedTokenizerFast whose tokenizer.json post-processor
    prepends <|begin_of_text|>; tokenizer_config.json says nothing about BOS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab=vocab.ids, merges=vocab.merges, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    bos_id = vocab.ids[family.bos]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{family.bos}:0 $A:0", pair=f"{family.bos}:0 $A:0 {family.bos}:1 $B:1",
        special_tokens=[(family.bos, bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=family.bos,
                                   eos_token=family.eos)


def generation_config(family: FamilyTokenizer, vocab: Vocabulary) -> dict[str, Any]:
    """generation_config.json for the HF form: token names resolved to ids."""
    ids = vocab.ids
    config = {k: v for k, v in family.generation.items() if k != "eos_token_id"}
    config["eos_token_id"] = [ids[t] for t in family.generation.get("eos_token_id",
                                                                      [family.eos])]
    if family.bos:
        config["bos_token_id"] = ids[family.bos]
    return config


def gguf_tokenizer_fields(writer: Any, family: FamilyTokenizer, vocab: Vocabulary) -> None:
    """Write `tokenizer.ggml.*` and the chat template the way llama.cpp's converter does."""
    from gguf import TokenType

    ids = vocab.ids
    writer.add_tokenizer_model("llama" if family.kind == "sentencepiece" else "gpt2")
    writer.add_tokenizer_pre(family.gguf_pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types([_token_type(t, family, TokenType) for t in vocab.tokens])
    if family.kind == "sentencepiece":
        writer.add_token_scores(vocab.scores)
    else:
        writer.add_token_merges([f"{a} {b}" for a, b in vocab.merges])
    writer.add_bos_token_id(ids[family.bos or family.specials[0]])
    writer.add_eos_token_id(ids[family.eos])
    if family.pad:
        writer.add_pad_token_id(ids[family.pad])
    if family.unk:
        writer.add_unk_token_id(ids[family.unk])
    if family.end_of_turn:
        writer.add_eot_token_id(ids[family.end_of_turn])
    if family.add_bos is not None:
        writer.add_add_bos_token(family.add_bos)
    writer.add_add_eos_token(False)
    writer.add_chat_template(family.chat_template)


def _token_type(token: str, family: FamilyTokenizer, types: Any) -> int:
    if token == family.unk:
        return types.UNKNOWN
    if token in family.specials:
        return types.CONTROL
    if token in family.user_defined:
        return types.USER_DEFINED
    if family.kind == "sentencepiece" and len(token) == 6 and token.startswith("<0x"):
        return types.BYTE
    return types.NORMAL
