"""Self-distillation data: the target's own greedy continuations."""

from __future__ import annotations

import pytest
import torch

from llmopt.compiler.draft_pairing import pairing_inputs
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel
from llmopt.passes import draft

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def test_self_distillation_data_is_the_targets_greedy_continuation(target, word_text):
    """`distill_data: self` windows: prompt + the target's greedy argmax chain, the mask
    on exactly the positions that predict continuation tokens."""
    from llmopt.passes.draft import data as draft_data
    from llmopt.passes.draft.choice import target_tokenizer

    recipe = Recipe(model="unused", calibration={"text": str(word_text)},
                    runtime={"block_size": 4, "max_context": 128})
    context = pairing_inputs(recipe, lambda _: None)
    data = draft._self_windows(target, draft.make_config(kind="tiny", distill_data="self",
                                                    distill_prompts=5,
                                                    distill_new_tokens=6), context)
    assert data.report["prompts"] == 5 and data.report["continuation_tokens"] >= 5
    assert data.ids.shape == data.mask.shape and data.mask.sum() == (
        data.report["continuation_tokens"])
    prompts = draft_data.self_prompts(target, target_tokenizer(target), 5, str(word_text))
    logits = ReferenceModel(target).forward(data.ids)
    for row, prompt in enumerate(prompts):
        assert data.ids[row, : len(prompt)].tolist() == prompt
        positions = torch.nonzero(data.mask[row]).flatten()
        assert positions[0] == len(prompt) - 1 and len(positions) <= 6
        assert (logits[row, positions].argmax(-1) == data.ids[row, positions + 1]).all()


def test_without_text_every_prompt_is_another_instruction(target):
    """The `corpus: self` prompts (no text file): each instruction once, so the corpus holds
    as many different answers as prompts (repeats would only count the same n-grams again)."""
    from llmopt.passes.draft import data as draft_data
    from llmopt.passes.draft.choice import target_tokenizer

    count = len(draft_data.INSTRUCTIONS)
    prompts = draft_data.self_prompts(target, target_tokenizer(target), count, None)
    assert len({tuple(p) for p in prompts}) == count


# Words a request's genre shares with others ("a Python function", "the difference between")
GENRE_WORDS = {"python", "function", "class", "javascript", "between", "difference", "three",
               "five", "small", "day"}
FILLER = {"a", "an", "the", "of", "to", "in", "and", "or", "for", "with", "that", "this", "what",
          "is", "are", "how", "do", "i", "my", "me", "your", "you", "it", "its", "be", "as", "on",
          "by", "from", "at", "into", "about", "write", "give", "make", "explain", "list",
          "describe", "who"}


def test_no_instruction_shares_a_topic_with_the_benchmark_prompts(target):
    """The instructions' answers are the `corpus: self` n-gram corpus: one on a speculation
    benchmark prompt's topic would grade the corpus on its own answer. Beyond genre words,
    an instruction and a prompt share at most one content word."""
    import importlib.util
    import json
    import re
    from pathlib import Path

    from llmopt.passes.draft import data as draft_data

    benchmarks = Path(__file__).resolve().parents[3] / "benchmarks"
    spec = importlib.util.spec_from_file_location("bench_speculative",
                                                  benchmarks / "bench_speculative.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lines = (benchmarks / "prompts" / "spec_mix_v2.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if '"prompt"' in line]
    prompts += [str(p) for mix in bench.PROMPTS.values() for p in mix]

    def words(text: str) -> set[str]:
        return {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) > 2} - FILLER

    for instruction in draft_data.INSTRUCTIONS:
        for prompt in prompts:
            shared = words(instruction) & words(prompt)
            assert len(shared - GENRE_WORDS) <= 1 and len(shared) <= 2, (instruction, prompt)
