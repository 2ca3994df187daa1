"""Self-distillation data: the target's own greedy continuations."""

from __future__ import annotations

import pytest
import torch

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
    context = type("Context", (), {"recipe": recipe, "log": staticmethod(lambda _: None)})()
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
