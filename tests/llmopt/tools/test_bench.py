"""bench's prompts: realistic text by default for a speculating artifact, named either way."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from toy_artifact import add_draft, build_artifact

from llmopt.cli import main
from llmopt.runtime import LLM
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.texts import PASSAGES
from llmopt.tools.bench import bench_prompts, generate_timed, prompt_kind, run_bench
from llmopt.tools.bench_text import text_prompts


def test_auto_is_text_exactly_when_the_artifact_speculates():
    assert prompt_kind("auto", speculates=True) == "text"
    assert prompt_kind("auto", speculates=False) == "random"
    assert prompt_kind("random", speculates=True) == "random"


def test_text_prompts_are_distinct_and_of_the_asked_length(tiny_checkpoints, tmp_path):
    from llmopt.compiler.pipeline import compile_recipe
    from llmopt.compiler.recipe import Recipe

    recipe = Recipe.model_validate({"model": str(tiny_checkpoints["llama"]),
                                    "runtime": {"max_context": 64}})
    compile_recipe(recipe, tmp_path / "a", log=print)
    llm = LLM(tmp_path / "a")
    batch = len(PASSAGES) + 2  # past the last passage the prompts are numbered
    frame = llm.tokenizer.apply_chat_template([{"role": "user", "content": "\0"}])
    before, after = (llm.tokenizer.encode(part, add_bos=False, add_eos=False)
                     for part in frame.split("\0"))
    chat = text_prompts(llm.tokenizer, batch, 120)
    assert all(len(p) == 120 for p in chat)
    assert all(p[:len(before)] == before and p[-len(after):] == after for p in chat)
    # past the template's opening, no two prompts share a block of 16 tokens
    assert len({tuple(p[len(before):len(before) + 16]) for p in chat}) == batch
    plain = text_prompts(llm.tokenizer, batch, 40)  # too short for the chat frame: plain text
    assert all(len(p) == 40 for p in plain) and plain[0][:len(before)] != before
    assert len({tuple(p[:16]) for p in plain}) == batch
    long = text_prompts(llm.tokenizer, 1, 3000)[0]  # longer than every passage together
    assert len(long) == 3000 and llm.tokenizer.eos_token_id not in long
    result = run_bench(llm, 2, 16, 3, prompts_kind="text")
    assert (result.prompts, result.batch) == ("text", 2)


@pytest.fixture(scope="module")
def speculating(tmp_path_factory):
    return add_draft(build_artifact(tmp_path_factory.mktemp("toy")), gamma=2, ngram=True)


@pytest.mark.parametrize(("extra", "line"), [
    ([], "prompts: text (built-in English passages, asked about in chat form when the "
         "artifact has a chat template; --prompts random for random token ids)"),
    (["--prompts", "random"],
     "prompts: random token ids (they flatter speculation; --prompts text for real text)"),
    (["--no-speculative"],
     "prompts: random token ids (they flatter speculation; --prompts text for real text)"),
])
def test_bench_says_which_prompts_ran(speculating, extra, line):
    result = CliRunner().invoke(main, ["bench", str(speculating), "--batch", "1",
                                       "--prompt-len", "8", "--gen-len", "4", *extra])
    assert result.exit_code == 0, result.output
    assert line in result.output.splitlines()



@pytest.mark.parametrize(("budget", "window_has_all"), [(64, True), (10, False)])
def test_the_decode_window_opens_at_the_last_first_token(tmp_path, budget, window_has_all):
    """Three prompts of 8 tokens: a step budget of 64 prefills them in one step, so every
    token but each stream's first falls in the decode window; a budget of 10 admits them a
    step apart, and the first streams' tokens during the later prefills fall before it."""
    llm = LLM(build_artifact(tmp_path / "toy"), max_num_seqs=3,
              max_num_batched_tokens=budget, enable_prefix_caching=False)
    prompts = bench_prompts(llm.manifest.model.vocab_size, 3, 8)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs, window = generate_timed(llm, prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in llm.generate(prompts, params)]
    assert window.seconds > 0
    assert (window.tokens == 3 * 5) is window_has_all
    # no stream's first token in it; the last stream's five others at least
    assert 5 <= window.tokens <= 3 * 5
