"""Shared pieces of the draft pass tests: tiny targets and drafts with word-level
tokenizers, and compiling an artifact with a draft."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from llmopt.compiler.pipeline import compile_recipe
from llmopt.compiler.recipe import Recipe
from llmopt.compiler.reference import ReferenceModel
from llmopt.runtime.artifact import load_manifest
from llmopt.runtime.executors.choose import make_executor
from llmopt.runtime.executors.step_batch import StepBatch

SPECIALS = ["<pad>", "<s>", "</s>"]
TARGET_TOKENS = SPECIALS + [chr(c) for c in range(32, 127)] + [f"w{i}" for i in range(158)]
# Measure little: the tests check the plumbing, not the numbers.
QUICK = {"prompts": 2, "new_tokens": 12, "batch_sizes": [1, 2], "cost_repeats": 1}


def save_draft(directory: Path, tokens: list[str], vocab_size: int) -> Path:
    """A random 1-layer llama whose word-level tokenizer has `tokens` as ids 0.."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    config = AutoConfig.for_model(
        model_type="llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=True)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(directory)
    return directory


# A subset in another order: the printable characters reversed, 20 of the words, and two
# padding rows past the tokenizer (logits rows that name no token).
SUBSET_TOKENS = SPECIALS + [chr(c) for c in range(126, 31, -1)] + [f"w{i}" for i in range(20)]


def compile_with_draft(target_dir: Path, text: Path, out: Path, **options) -> Path:
    recipe = Recipe(model=str(target_dir), passes=[{"draft": {**QUICK, **options}}],
                    calibration={"text": str(text)},
                    runtime={"block_size": 4, "max_context": 128})
    compile_recipe(recipe, out, log=lambda _: None)
    return out


def draft_logits(artifact: Path, tokens: list[int]) -> np.ndarray:
    """Run the artifact's draft graph through the runtime's executor for its KV layout."""
    manifest = load_manifest(artifact)
    spec = manifest.speculative.model
    executor = make_executor(artifact / manifest.graphs[spec.graph].file, spec.kv_cache,
                             num_blocks=65, block_size=4, lane_blocks=32,
                             max_position=spec.max_position)
    slots = np.arange(4, 4 + len(tokens), dtype=np.int64)  # blocks 1.. in order: lane 0
    batch = StepBatch([tokens], [0], [list(range(1, 1 + len(tokens) // 4 + 1))], slots,
                      np.arange(len(tokens), dtype=np.int64))
    return executor.execute(batch)


def truncated_logits(ir, ids: torch.Tensor, layers: int) -> torch.Tensor:
    model = ReferenceModel(ir)
    hidden, positions = model.embed(ids), torch.arange(ids.shape[1])
    with torch.no_grad():
        for index in range(layers):
            hidden = model.layer_forward(index, hidden, positions, None)
        return model.logits(hidden)
