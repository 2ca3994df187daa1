import jinja2
import pytest
import tokenizers
from runtime_fakes import make_word_tokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from llmopt.runtime.manifest import TokenizerSpec
from llmopt.runtime.tokenizer import IncrementalDetokenizer, Tokenizer, render_chat_template

# SmolLM2-Instruct's template, as its tokenizer_config.json ships it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXT = "héllo wörld, 😀 naïve café ünïcödé"


def byte_level_tokenizer() -> Tokenizer:
    """A byte-level BPE with few merges: multi-byte characters span several tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>"],
    )
    tok.train_from_iterator(["hello world " * 20, "naive cafe"], trainer)
    return Tokenizer(tok, TokenizerSpec(file="t.json", bos_token="<s>"))


def metaspace_tokenizer() -> Tokenizer:
    """SentencePiece style: "▁" marks spaces, and the decoder strips the first one."""
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<s>"])
    tok.train_from_iterator(["hello world again and again"] * 10, trainer)
    return Tokenizer(tok, TokenizerSpec(file="t.json", bos_token="<s>", add_bos_token=True))


def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add_tokens([i]) for i in ids]
    deltas.append(detokenizer.flush())
    assert "".join(deltas) == detokenizer.text
    return deltas


def test_encode_adds_bos_as_the_manifest_says():
    tokenizer = make_word_tokenizer()
    assert tokenizer.encode("w5 w6") == [5, 6]
    assert tokenizer.encode("w5 w6", add_bos=True) == [0, 5, 6]
    spm = metaspace_tokenizer()
    ids = spm.encode("hello world")
    assert ids[0] == spm.bos_token_id and ids.count(spm.bos_token_id) == 1
    assert spm.decode(ids) == "hello world"


def test_incremental_detokenization_never_splits_a_character():
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT) // 2  # many byte tokens: characters really are split
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenization_keeps_sentencepiece_spaces():
    tokenizer = metaspace_tokenizer()
    ids = tokenizer.encode("hello world again", add_bos=False)
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == "hello world again" == tokenizer.decode(ids)


def test_an_incomplete_final_character_is_flushed():
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("ok 😀")[:-1]  # cut inside the emoji's bytes
    detokenizer = IncrementalDetokenizer(tokenizer)
    for i in ids:
        detokenizer.add_tokens([i])
    assert detokenizer.text == "ok "
    detokenizer.flush()
    assert detokenizer.text == tokenizer.decode(ids)


def test_smollm2_chat_template():
    messages = [{"role": "user", "content": "Hi"}]
    text = render_chat_template(SMOLLM2_TEMPLATE, messages, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    text = render_chat_template(SMOLLM2_TEMPLATE, messages, add_generation_prompt=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n")


def test_template_helpers_and_sandbox():
    template = (
        "{{ bos_token }}{{ messages | tojson }}"
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    )
    text = render_chat_template(template, [{"role": "user", "content": "é"}], bos_token="<s>")
    assert text == '<s>[{"role": "user", "content": "é"}]'
    with pytest.raises(jinja2.TemplateError, match="one message only"):
        render_chat_template(template, [{}, {}])
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template("{{ messages.append(1) }}", [])


def test_chat_prompt_gets_no_second_bos():
    spec = TokenizerSpec(
        file="t.json",
        bos_token="<s>",
        eos_token="</s>",
        add_bos_token=True,
        chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    tokenizer = make_word_tokenizer(spec)
    assert tokenizer.encode_chat([{"role": "user", "content": "w7 w8"}]) == [0, 7, 8]
    with pytest.raises(ValueError, match="no chat template"):
        make_word_tokenizer().apply_chat_template([])


def test_spec_ids_and_eos_are_applied_as_written():
    spec = TokenizerSpec(file="t.json", bos_token="<s>", eos_token="</s>", bos_token_id=1,
                         eos_token_id=0, add_bos_token=True, add_eos_token=True)
    tokenizer = make_word_tokenizer(spec)  # the spec's ids win over the vocabulary's
    assert tokenizer.encode("w5 w6") == [1, 5, 6, 0]
    assert tokenizer.encode("w5", add_bos=False, add_eos=False) == [5]
    with pytest.raises(ValueError, match="add_eos_token"):
        make_word_tokenizer(TokenizerSpec(file="t.json", add_eos_token=True))


def test_template_sees_what_transformers_passes():
    """The named special tokens, tools/documents as None (not undefined), and messages
    without their None-valued keys."""
    template = ("{{ pad_token }}{% if tools is not none %}TOOLS{% endif %}"
                "{% for m in messages %}{{ m['role'] }}"
                "{% if m['name'] is defined %}={{ m['name'] }}{% endif %}{% endfor %}")
    spec = TokenizerSpec(file="t.json", chat_template=template,
                         template_tokens={"pad_token": "w9", "bos_token": "<s>"})
    tokenizer = make_word_tokenizer(spec)
    messages = [{"role": "user", "content": "w5", "name": None}]
    assert tokenizer.apply_chat_template(messages) == "w9user"
    assert tokenizer.apply_chat_template(messages, tools=[{"name": "f"}]) == "w9TOOLSuser"


def byte_fallback_tokenizer() -> Tokenizer:
    """SentencePiece-style BPE with byte fallback: unknown characters become <0x..> tokens."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁a": 257, "a": 258}
    tok = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return Tokenizer(tok, TokenizerSpec(file="t.json"))


def test_streamed_text_equals_decoding_an_invalid_byte_run():
    """A run of byte tokens that is not UTF-8 decodes to U+FFFD per byte, valid ASCII
    bytes included: text streamed from inside the run would differ from the decode."""
    tokenizer = byte_fallback_tokenizer()
    byte = {b: 1 + b for b in range(256)}
    ids = [257, byte[0x43], byte[0xE2], byte[0x80], 258, byte[0xF0], 257]
    assert tokenizer.decode(ids) == "a���a� a"
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert deltas == ["a", "", "", "", "���a", "", "� a", ""]  # each run waits for its end
    emoji = [258, byte[0xF0], byte[0x9F], byte[0x98], byte[0x80], 257]
    assert stream(tokenizer, emoji) == ["a", "", "", "", "", "😀 a", ""]
