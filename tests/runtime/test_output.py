"""Stop strings: the text is decode(token_ids) cut at the stop string that `stop_reason`
names; token_ids keep every sampled token (vLLM's contract)."""

from runtime_fakes import make_engine, make_word_tokenizer, reference_greedy, run_engine

from llmopt.runtime.output import OutputText
from llmopt.runtime.sampling_params import SamplingParams

PROMPT = [5, 6, 7]


def stopped(stop: list[str], **params):
    tokenizer = make_word_tokenizer()
    engine = make_engine(tokenizer=tokenizer)
    (out,) = run_engine(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=12,
                                                          stop=stop, **params))
    return out, tokenizer


def test_the_text_is_the_token_ids_decoded_and_cut_at_the_named_stop_string():
    expected = reference_greedy(PROMPT, 12)
    tokenizer = make_word_tokenizer()
    stop = tokenizer.decode(expected[4:6])  # "wA wB": completed by token 5
    out, _ = stopped([stop, "never-seen"])
    full = tokenizer.decode(out.token_ids)
    assert out.token_ids == expected[:6]  # up to the token that completed the stop string
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert full.startswith(out.text) and full[len(out.text):].startswith(stop)
    assert stop not in tokenizer.decode(out.token_ids[:-1])  # nothing sampled past it


def test_include_stop_str_in_output_keeps_the_stop_string_in_the_text():
    expected = reference_greedy(PROMPT, 12)
    tokenizer = make_word_tokenizer()
    stop = tokenizer.decode(expected[4:6])
    out, _ = stopped([stop], include_stop_str_in_output=True)
    assert out.token_ids == expected[:6] and out.stop_reason == stop
    assert out.text == tokenizer.decode(expected[:6])  # text and token ids agree exactly


def test_the_earliest_of_several_stop_strings_wins():
    expected = reference_greedy(PROMPT, 12)
    tokenizer = make_word_tokenizer()
    full = tokenizer.decode(expected)
    stops = [tokenizer.decode(expected[8:10]), tokenizer.decode(expected[3:5])]
    first = min(stops, key=full.find)
    out, _ = stopped(stops)
    assert out.stop_reason == first and out.text == full[: full.find(first)]


def test_stop_reason_names_a_stop_token_id_and_is_none_for_length():
    expected = reference_greedy(PROMPT, 12)
    engine = make_engine(tokenizer=make_word_tokenizer())
    (out,) = run_engine(engine, [PROMPT], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[expected[5]]))
    assert (out.finish_reason, out.stop_reason) == ("stop", expected[5])
    (out,) = run_engine(engine, [PROMPT], SamplingParams(temperature=0, max_tokens=3))
    assert (out.finish_reason, out.stop_reason) == ("length", None)


def test_a_stop_string_split_across_tokens_is_held_back_then_cut():
    tokenizer = make_word_tokenizer()
    text = OutputText(tokenizer, ["w9 w10"])
    ids = tokenizer.encode("w3 w9 w10 w11", add_bos=False)
    assert not text.add_tokens(ids[:2]) and "w9" not in text.visible_text(False)
    assert text.add_tokens(ids[2:3]) and text.stop_string == "w9 w10"
    assert text.visible_text(True) == tokenizer.decode(ids[:3])[: -len("w9 w10")]
