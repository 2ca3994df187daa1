"""bench's prompts: realistic text by default for a speculating artifact, named either way."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from toy_artifact import add_draft, build_artifact

from llmopt.cli import main
from llmopt.runtime import LLM
from llmopt.runtime.bench import prompt_kind, run_bench
from llmopt.runtime.bench_text import PASSAGES, text_prompts


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
